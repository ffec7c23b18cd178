"""Index-level input sharding (data/worker_shards.py), in one process: each worker's loader yields the
part of each global batch that slicing it would keep, with the global size; the multi-process run is
tests/test_multi_worker_index_shards.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from stratagem.data.distributed_sampler import PerWorkerLoader, WorkerBatch
from stratagem.data.resume import ShuffledBatches
from stratagem.data.worker_shards import (
    WorkerLoader,
    WorkerPart,
    WorkerRange,
    WorkerShuffledBatches,
    input_sharding,
    observed_sharding,
    shard_input,
    why_not_shardable,
)
from stratagem.errors import InputError

X = torch.arange(23, dtype=torch.float64).reshape(23, 1)
Y = torch.arange(23) * 10


def test_a_workers_bounds_are_its_replicas_contiguous_pieces():
    # 2 workers x 1 replica: the first worker takes the larger half.
    assert [WorkerRange(2, r, 1).bounds(7) for r in (0, 1)] == [(0, 4), (4, 7)]
    # 2 workers x 2 replicas, 10 examples: pieces 3, 3, 2, 2.
    assert [WorkerRange(4, r * 2, 2).bounds(10) for r in (0, 1)] == [(0, 6), (6, 10)]
    # A batch smaller than the replicas: the last worker's part is empty.
    assert WorkerRange(3, 2, 1).bounds(2) == (2, 2)


def _loader(**kwargs):
    return DataLoader(
        TensorDataset(X, Y), batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(4), **kwargs
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_parts_of_a_shuffling_loader_put_together_are_its_global_batches(num_workers):
    expected = list(_loader())  # the same seed: the same permutation
    parts = [list(WorkerLoader(_loader(num_workers=num_workers), WorkerRange(2, r, 1))) for r in (0, 1)]
    assert len(parts[0]) == len(parts[1]) == len(expected) == 5
    for (x, y), a, b in zip(expected, *parts):
        assert a.global_size == b.global_size == len(y)
        half = (len(y) + 1) // 2
        torch.testing.assert_close(a.batch[1], y[:half])
        torch.testing.assert_close(b.batch[1], y[half:])
        torch.testing.assert_close(torch.cat([a.batch[0], b.batch[0]]), x)


def test_a_worker_whose_part_is_empty_gets_an_empty_batch_and_drop_last_and_collate_are_kept():
    def as_dict(samples):
        return {"x": torch.stack([s[0] for s in samples]), "y": torch.stack([s[1] for s in samples])}

    # 23 examples in batches of 11: the last batch (1 example) leaves the second of 2 workers nothing.
    loader = DataLoader(TensorDataset(X, Y), batch_size=11, collate_fn=as_dict)
    second = list(WorkerLoader(loader, WorkerRange(2, 1, 1)))
    assert [p.global_size for p in second] == [11, 11, 1]
    assert [len(p.batch["y"]) for p in second] == [5, 5, 0]
    assert second[2].batch["x"].shape == (0, 1)
    dropping = DataLoader(TensorDataset(X, Y), batch_size=11, drop_last=True)
    assert [p.global_size for p in WorkerLoader(dropping, WorkerRange(2, 0, 1))] == [11, 11]


def test_an_abandoned_pass_does_not_shift_the_next_passes_sizes():
    sharded = WorkerLoader(DataLoader(TensorDataset(X, Y), batch_size=10), WorkerRange(2, 0, 1))
    first = iter(sharded)
    next(first)
    assert [p.global_size for p in sharded] == [10, 10, 3]


def test_each_worker_asks_its_data_set_only_for_its_part():
    class Counting(Dataset):
        def __init__(self):
            self.asked = []

        def __len__(self):
            return 23

        def __getitem__(self, i):
            self.asked.append(i)
            return X[i], Y[i]

    data = Counting()
    parts = list(WorkerLoader(DataLoader(data, batch_size=10), WorkerRange(2, 1, 1)))
    # 0: the pass's first example, read by every worker for the batch check (data/probe.py)
    assert sorted(data.asked) == [0, 5, 6, 7, 8, 9, 15, 16, 17, 18, 19, 22]  # the last batch: 20, 21 | 22
    assert [p.global_size for p in parts] == [10, 10, 3]


def test_parts_of_shuffled_batches_follow_its_position():
    source = ShuffledBatches((X, Y), batch_size=6, seed=3)
    expected = list(ShuffledBatches((X, Y), batch_size=6, seed=3))
    workers = [shard_input(ShuffledBatches((X, Y), batch_size=6, seed=3), WorkerRange(2, r, 1)) for r in (0, 1)]
    assert isinstance(workers[0], WorkerShuffledBatches)
    parts = [list(w) for w in workers]
    for (_, y), a, b in zip(expected, *parts):
        assert a.global_size == len(y)
        torch.testing.assert_close(torch.cat([a.batch[1], b.batch[1]]), y)
    # Mid-epoch: the position and the state are the source's.
    source.set_position(1, 2)
    resumed = list(ShuffledBatches((X, Y), batch_size=6, seed=3).batch_indices())  # epoch 0
    sharded = WorkerShuffledBatches(source, WorkerRange(2, 0, 1))
    assert sharded.batches_left == 2 and sharded.state_dict()["offset"] == 2
    got = list(sharded)
    assert [p.global_size for p in got] == [6, 5]
    assert len(resumed) == 4 and source.epoch == 2


def test_inputs_that_cannot_be_cut_by_index_say_why():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from zip(X, Y)

    assert why_not_shardable(_loader()) is None
    assert "IterableDataset" in why_not_shardable(DataLoader(Stream(), batch_size=4))
    assert "batch_size=None" in why_not_shardable(DataLoader(TensorDataset(X, Y), batch_size=None))
    assert "list" in why_not_shardable([(X, Y)])
    assert "in_order=False" in why_not_shardable(DataLoader(TensorDataset(X, Y), batch_size=4, in_order=False))
    assert isinstance(next(iter(WorkerLoader(_loader(), WorkerRange(1, 0, 1)))), WorkerPart)


def test_the_decision_is_taken_from_the_input_or_else_from_a_streams_first_batch():
    worker = WorkerRange(2, 0, 1)
    sharded, decision = input_sharding(_loader(), worker)
    assert isinstance(sharded, WorkerLoader) and decision[0] == "index level"
    assert input_sharding(sharded, worker) == (sharded, None)  # cut already (fit cuts before the strategy sees it)
    batches = [(X, Y)]
    assert input_sharding(batches, worker) == (
        batches,
        ("each worker slices every global batch", why_not_shardable(batches)),
    )
    stream = iter(batches)
    assert input_sharding(stream, worker) == (stream, None)
    assert observed_sharding(True, stream, None)[0] == "index level"
    assert observed_sharding(True, stream, "index level") is None
    assert observed_sharding(False, stream, None) == (
        "each worker slices every global batch",
        why_not_shardable(stream),
    )
    assert observed_sharding(False, stream, "index level") is None  # fit's wrapping of validation data, say
    assert observed_sharding(False, batches, "index level") == (
        "each worker slices every global batch",
        why_not_shardable(batches),
    )
    parts = list(sharded)
    assert input_sharding(parts, worker) == (parts, None)  # fit's accumulation groups


def _ddp_loader(rank, num_replicas=2, inside_batch_sampler=False):
    sampler = DistributedSampler(TensorDataset(X, Y), num_replicas=num_replicas, rank=rank, shuffle=True, seed=6)
    if inside_batch_sampler:
        return DataLoader(TensorDataset(X, Y), batch_sampler=BatchSampler(sampler, 4, drop_last=False))
    return DataLoader(TensorDataset(X, Y), batch_size=4, sampler=sampler)


@pytest.mark.parametrize("inside_batch_sampler", [False, True], ids=["sampler", "in-batch-sampler"])
def test_a_loader_with_a_distributed_sampler_is_read_whole_as_the_workers_own(inside_batch_sampler):
    # Rank 1 of 2 workers with one replica each, then with two: the sampler's 12 examples (23 and one padded)
    # are this worker's part already, so its batches are not cut again.
    for worker in (WorkerRange(2, 1, 1), WorkerRange(4, 2, 2)):
        loader = _ddp_loader(1, inside_batch_sampler=inside_batch_sampler)
        expected = list(_ddp_loader(1))
        wrapped, decision = input_sharding(loader, worker)
        assert isinstance(wrapped, PerWorkerLoader) and len(wrapped) == len(expected) == 3
        assert (
            decision[0] == "each worker's own loader"
            and "DistributedSampler gives each worker its own 1/2" in decision[1]
        )
        batches = list(wrapped)
        assert all(isinstance(b, WorkerBatch) for b in batches)
        for (x, y), got in zip(expected, batches):
            torch.testing.assert_close(got.batch[1], y)
            torch.testing.assert_close(got.batch[0], x)
        assert input_sharding(wrapped, worker) == (wrapped, None)
        assert input_sharding(batches, worker) == (batches, None)  # fit's accumulation groups
    # set_epoch reaches the sampler wherever it sits: the next epoch's order, as DDP's loop gets it.
    wrapped.set_epoch(3)
    reference = _ddp_loader(1)
    reference.sampler.set_epoch(3)
    torch.testing.assert_close(next(iter(wrapped)).batch[1], next(iter(reference))[1])


def test_a_distributed_sampler_for_another_cluster_is_refused():
    with pytest.raises(
        InputError,
        match=r"The DataLoader's DistributedSampler splits the data among 4 processes and "
        r"reads the part of rank 1, but this job has 2 workers and this one is rank "
        r"0\. Received: DistributedSampler\(num_replicas=4, rank=1\)\. Build it after "
        r"the strategy, with num_replicas and rank left unset",
    ):
        input_sharding(_ddp_loader(1, num_replicas=4), WorkerRange(4, 0, 2))
