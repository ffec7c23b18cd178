"""Workers cut at the index level hold different examples of each global batch, so the batch check also reads
one example of it on every worker and compares its values (issue 38: a data set built from unseeded random
numbers on each worker trained each worker on other data without a word). The read's rules, one process."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from stratagem.data import probe
from stratagem.data.resume import ShuffledBatches
from stratagem.data.worker_shards import WorkerLoader, WorkerRange, shard_input


def _data(seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(70, 5, generator=g), torch.randint(0, 3, (70,), generator=g))


class Augmented(Dataset):
    """Random noise from torch, Python and NumPy on every read, as augmentations draw it."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        noise = torch.randn(()) + random.random() + float(np.random.rand())
        return self.x[i] + noise, i


def test_data_sets_from_other_seeds_give_other_digests_and_equal_ones_the_same():
    assert probe.example_digest(_data(0), 7) == probe.example_digest(_data(0), 7)
    assert probe.example_digest(_data(0), 7) != probe.example_digest(_data(1), 7)
    assert probe.example_digest(_data(0), 7) != probe.example_digest(_data(0), 8)


def test_a_randomly_augmented_read_gives_one_digest_and_leaves_the_random_streams_alone():
    data = Augmented(torch.arange(10.0))
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    first = probe.example_digest(data, 3)
    torch.rand(5), random.random(), np.random.rand()  # another position in every stream
    assert probe.example_digest(data, 3) == first
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    probe.example_digest(data, 3)
    after = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(after[0], expected[0]) and after[1:] == expected[1:]


def test_a_read_that_raises_gives_a_digest_and_no_error():
    class Broken(Dataset):
        def __getitem__(self, i):
            raise RuntimeError("only in a loader worker")

    assert probe.example_digest(Broken(), 0) == probe.example_digest(Broken(), 1)


def _parts(seed: int, rank: int) -> list:
    loader = DataLoader(_data(seed), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(4))
    return list(WorkerLoader(loader, WorkerRange(2, rank, 1)))


def test_every_worker_carries_the_same_example_digest_at_the_first_batch_and_every_probe_every():
    carried = [[p.checked_example for p in _parts(0, rank)] for rank in (0, 1)]
    assert carried[0] == carried[1] and len(carried[0]) == 35
    assert [i for i, c in enumerate(carried[0]) if c is not None] == [0, probe.PROBE_EVERY]
    first_index = carried[0][0][0]
    assert torch.equal(_parts(0, 0)[0].batch[0][0], _data(0)[first_index][0])  # the chief's first: the global first
    assert carried[0][0][1] == probe.example_digest(_data(0), first_index)


def test_a_worker_whose_data_set_was_built_from_another_seed_carries_another_digest_for_the_same_indices():
    mine, other = _parts(0, 1)[0], _parts(1, 1)[0]
    assert other.indices_digest == mine.indices_digest  # all the check compared before: equal
    assert other.checked_example is not None and mine.checked_example is not None
    assert other.checked_example[0] == mine.checked_example[0] and other.checked_example[1] != mine.checked_example[1]


def test_shuffled_batches_cut_by_index_carry_the_digest_too():
    x, y = _data(0).tensors
    carried = [
        [p.checked_example for p in shard_input(ShuffledBatches((x, y), batch_size=4, seed=2), WorkerRange(2, r, 1))]
        for r in (0, 1)
    ]
    assert carried[0] == carried[1] and carried[0][0] is not None and carried[0][1] is None
    changed = [
        p.checked_example for p in shard_input(ShuffledBatches((x + 1, y), batch_size=4, seed=2), WorkerRange(2, 1, 1))
    ]
    assert changed[0][0] == carried[0][0][0] and changed[0][1] != carried[0][0][1]
