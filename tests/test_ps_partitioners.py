"""Partitioners follow tf.distribute's rules; shards are contiguous, the first ones take the extra rows."""

from __future__ import annotations

import pytest
import torch

from stratagem.errors import InputError
from stratagem.strategies.parameter_server.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    place,
    shard_of,
    shard_rows,
)


def test_shard_rows_first_shards_take_the_extra_rows():
    assert shard_rows(13, 5) == [3, 3, 3, 2, 2]
    assert shard_rows(12, 4) == [3, 3, 3, 3]
    assert shard_rows(2, 3) == [1, 1, 0]


def test_fixed_shards_is_min_of_n_and_rows():
    assert FixedShardsPartitioner(5)((13, 4), torch.float32) == 5
    assert FixedShardsPartitioner(8)((3, 2), torch.float32) == 3
    assert FixedShardsPartitioner(8)((), torch.float32) == 1


def test_min_size_partitioner():
    # 1000 x 256 float32 = 1,024,000 bytes; / 262,144 = 3.9 -> 4 shards.
    assert MinSizePartitioner(max_shards=8)((1000, 256), torch.float32) == 4
    # 500 x 256 float32 = 512,000 bytes -> 1.95 -> 2.
    assert MinSizePartitioner(max_shards=8)((500, 256), torch.float32) == 2
    # max_shards defaults to 1.
    assert MinSizePartitioner()((1000, 256), torch.float32) == 1
    # 3 rows of 400,000 bytes: 4.6 -> 5, but only 3 rows.
    assert MinSizePartitioner(max_shards=10)((3, 100_000), torch.float32) == 3
    # TF's own doc example: 6 x 1 float32 with 4-byte minimum.
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), torch.float32) == 2
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), torch.float32) == 6


def test_max_size_partitioner():
    # 10 x 5 float32: 20-byte rows, 5 rows fit in 100 bytes -> 2 shards.
    assert MaxSizePartitioner(max_shard_bytes=100)((10, 5), torch.float32) == 2
    # A row bigger than the maximum: one row per shard, capped by max_shards.
    assert MaxSizePartitioner(max_shard_bytes=10)((10, 5), torch.float32) == 10
    assert MaxSizePartitioner(max_shard_bytes=10, max_shards=4)((10, 5), torch.float32) == 4
    # 13 float64 rows, 3 per 24 bytes -> 5 shards of 3, 3, 3, 2, 2 rows.
    assert MaxSizePartitioner(max_shard_bytes=24)((13, 1), torch.float64) == 5


def test_place_round_robin_whole_tensors_without_partitioner():
    params = [("a", torch.zeros(5, 2), 0), ("b", torch.zeros(3), 0), ("c", torch.tensor(1.0), 1)]
    got = [(s.name, s.ps, s.start, s.stop, s.group) for s in place(params, 3, None)]
    assert got == [("a", 0, 0, 5, 0), ("b", 1, 0, 3, 0), ("c", 2, 0, 1, 1)]


def test_place_partitions_and_deals_shards_round_robin():
    params = [("a", torch.zeros(5, 2), 0), ("b", torch.zeros(3), 0), ("c", torch.tensor(1.0), 0)]
    got = [(s.name, s.ps, s.start, s.stop) for s in place(params, 2, FixedShardsPartitioner(2))]
    assert got == [
        ("a/part_0", 0, 0, 3),
        ("a/part_1", 1, 3, 5),
        ("b/part_0", 0, 0, 2),
        ("b/part_1", 1, 2, 3),
        ("c", 0, 0, 1),
    ]
    w = torch.arange(10.0).reshape(5, 2)
    shards = place([("w", w, 0)], 2, FixedShardsPartitioner(2))
    assert torch.equal(torch.cat([shard_of(w, s) for s in shards]), w)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: FixedShardsPartitioner(0), "num_shards must be a positive integer. Received: num_shards=0"),
        (lambda: MinSizePartitioner(min_shard_bytes=-1), "min_shard_bytes must be a positive integer"),
        (lambda: MinSizePartitioner(max_shards=1.5), "max_shards must be a positive integer"),
        (lambda: MaxSizePartitioner(max_shard_bytes=0), "max_shard_bytes must be a positive integer"),
        (lambda: place([], 0, None), "num_ps must be a positive integer"),
        (lambda: place([("w", torch.zeros(2), 0)], 1, "fixed"), "partitioner must be callable"),
        (lambda: place([("w", torch.zeros(2), 0)], 1, lambda shape, dtype: 7), "impossible shard count. Received: 7"),
    ],
)
def test_bad_arguments_are_refused(make, match):
    with pytest.raises(InputError, match=match):
        make()
