"""Index-level input sharding: each worker builds only its part of every global batch.

Under MultiWorkerMirroredStrategy every worker trains on its contiguous part of each global
batch: replicas `[first, first + count)` of `split_sizes(global_size, num_replicas)`. When the
input says which examples a global batch holds before reading them (a DataLoader over a map-style
data set with a batch sampler, or a `ShuffledBatches`), a worker can ask its data set for exactly
those examples, so loading scales with the number of workers. Every worker draws the same global
batches (the same sampler, seeded alike), so the parts are the ones slicing each global batch
would keep, in the same order.

Each part travels as a `WorkerPart`, which carries the step's GLOBAL batch size: the replicas'
weights are their share of the global batch, which a worker no longer sees whole, and what the
workers' batch check compares: a hash of the global batch's indices and, at some batches, of the
values of its first example, which every worker reads for it (`probe.py`): equal indices alone do not
mean equal data sets.

Inputs that do not name a batch's examples before building it (an IterableDataset, a generator,
a list of batches) cannot be cut before reading; `why_not_shardable` says why, and the strategy
slices each global batch instead. A DataLoader with torch's DistributedSampler is cut per worker
already and is read whole (data/distributed_sampler.py).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from stratagem.data import distributed_sampler, probe
from stratagem.data.resume import ShuffledBatches
from stratagem.data.split import split_sizes
from stratagem.values import map_structure

INDEX_LEVEL = "index level"
SLICES = "each worker slices every global batch"


def indices_digest(indices: Any) -> int:
    """A 24-bit hash of a global batch's example indices, in order (what its sampler drew)."""
    text = ",".join(str(int(i)) for i in indices).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=3).digest(), "little")


@dataclass(frozen=True)
class WorkerPart:
    """This worker's contiguous part of one global batch, and the size of that global batch."""

    batch: Any
    global_size: int
    indices_digest: int | None = None
    """A hash of the global batch's example indices (`indices_digest`), by which the workers check that they
    cut the same global batch; None where the source does not say."""
    checked_example: tuple[Any, int] | None = None
    """(index, `probe.example_digest`) of the global batch's first example, which every worker reads so that the
    workers compare the values of their data sets too; None at the batches that carry none (`probe.due`)."""


@dataclass(frozen=True)
class WorkerRange:
    """Which replicas of the global batch are this worker's: `count` of `num_replicas`, from `first` on."""

    num_replicas: int
    first: int
    count: int

    def bounds(self, global_size: int) -> tuple[int, int]:
        """The examples `[lo, hi)` of a global batch of `global_size` that are this worker's."""
        sizes = split_sizes(global_size, self.num_replicas)
        lo = sum(sizes[: self.first])
        return lo, lo + sum(sizes[self.first : self.first + self.count])


def why_not_shardable(data: Any) -> str | None:
    """None when `shard_input` can cut `data` at the index level; else why not, in words."""
    if isinstance(data, ShuffledBatches):
        return None
    if not isinstance(data, DataLoader):
        return (
            f"the input is a {type(data).__name__}, which yields whole global batches without naming their "
            "examples beforehand, so each worker reads every one and keeps its part"
        )
    if type(data) is not DataLoader:
        return (
            f"the input is a DataLoader subclass ({type(data).__name__}), whose iteration may differ from DataLoader's"
        )
    if isinstance(data.dataset, IterableDataset):
        return "the DataLoader reads an IterableDataset, whose examples cannot be asked for by index"
    if data.batch_sampler is None:
        return "the DataLoader has no batch size (batch_size=None), so there is no global batch to cut by index"
    if not getattr(data, "in_order", True):
        return "the DataLoader has in_order=False, so its batches may arrive in another order on each worker"
    return None


def input_sharding(data: Any, worker: WorkerRange) -> tuple[Any, tuple[str, str] | None]:
    """What `worker` iterates for `data`, and the ("input sharding" choice, why) for `explain()`.

    The decision is None for a generator or other one-pass iterator: it may yield parts already cut
    (`fit` cuts its data before wrapping it), which only its first batch tells (`observed_sharding`).
    """
    if isinstance(data, (WorkerLoader, WorkerShuffledBatches)) or distributed_sampler.is_per_worker(data):
        return data, None
    if isinstance(data, list) and data and isinstance(data[0], WorkerPart):
        return data, None  # parts cut already, gathered in a list (fit's accumulation groups)
    sampler = distributed_sampler.distributed_sampler_of(data)
    if sampler is not None:
        # A DDP script's loader, each worker's 1/N already: read whole, never cut again.
        return distributed_sampler.per_worker_loader(
            data, sampler, worker.num_replicas // worker.count, worker.first // worker.count
        )
    why = why_not_shardable(data)
    if why is None:
        return shard_input(data, worker), (
            INDEX_LEVEL,
            (
                f"the input ({type(data).__name__}) names the examples of each global batch before reading them, so "
                "each worker reads only its part"
            ),
        )
    return data, None if isinstance(data, Iterator) else (SLICES, why)


def observed_sharding(index_level: bool, data: Any, current: str | None) -> tuple[str, str] | None:
    """At a pass's first batch: the decision its batches show, when `current` (the recorded one) differs.

    A one-pass iterator of global batches keeps a decision already recorded: it is `fit`'s wrapping of an
    input whose reason was recorded when `fit` looked at it (validation data that cannot be cut, say).
    """
    seen = INDEX_LEVEL if index_level else SLICES
    if current == seen or (not index_level and current is not None and isinstance(data, Iterator)):
        return None
    if index_level:
        return seen, "each batch is already this worker's part of a global batch, cut at the index level"
    return seen, why_not_shardable(data) or "the batches are global batches"


def shard_input(data: Any, worker: WorkerRange) -> Any:
    """`data` cut at the index level for `worker` (call `why_not_shardable` first)."""
    if isinstance(data, ShuffledBatches):
        return WorkerShuffledBatches(data, worker)
    return WorkerLoader(data, worker)


def _empty_part(batch: Any) -> Any:
    """A batch of no example with the structure of `batch` (a worker whose part of a small batch is empty)."""
    return map_structure(lambda t: t[:0] if isinstance(t, torch.Tensor) else t, batch)


class _PartSampler:
    """The loader's batch sampler, each batch cut to this worker's indices; notes each global size, in order."""

    def __init__(self, batch_sampler: Any, worker: WorkerRange, dataset: Any) -> None:
        self.batch_sampler = batch_sampler
        self.worker = worker
        self.dataset = dataset
        self.pending: collections.deque[tuple[int, bool, int, tuple[Any, int] | None]] = collections.deque()

    def __iter__(self) -> Iterator[list[int]]:
        for position, indices in enumerate(self.batch_sampler):
            indices = list(indices)
            lo, hi = self.worker.bounds(len(indices))
            mine = indices[lo:hi]
            # Read here, as the sampler is drawn (in this process, whatever the loader's num_workers).
            checked = (indices[0], probe.example_digest(self.dataset, indices[0])) if probe.due(position) else None
            self.pending.append((len(indices), bool(mine), indices_digest(indices), checked))
            # An empty part still needs a batch of the loader's structure: one example, dropped afterwards.
            yield mine if mine else indices[:1]

    def __len__(self) -> int:
        return len(self.batch_sampler)


class WorkerLoader:
    """A DataLoader that yields this worker's part of each of the original's global batches.

    The original's data set, batch sampler (its sampler, generator and drop_last with it), collate_fn,
    num_workers, pin_memory and the rest are kept; `sampler.set_epoch` reaches the original sampler.
    """

    def __init__(self, loader: DataLoader, worker: WorkerRange) -> None:
        self.original = loader
        self._parts = _PartSampler(loader.batch_sampler, worker, loader.dataset)
        extra: dict[str, Any] = {}
        if loader.num_workers > 0:
            extra["prefetch_factor"] = loader.prefetch_factor
        self._loader = DataLoader(
            loader.dataset,
            batch_sampler=self._parts,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
            generator=loader.generator,
            persistent_workers=loader.persistent_workers,
            pin_memory_device=loader.pin_memory_device,
            **extra,
        )

    @property
    def dataset(self) -> Any:
        return self.original.dataset

    @property
    def sampler(self) -> Any:
        return self.original.sampler

    @property
    def batch_size(self) -> int | None:
        return self.original.batch_size

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[WorkerPart]:
        pending = self._parts.pending
        pending.clear()  # what an abandoned iteration had prefetched; cleared before the new one prefetches
        for batch in self._loader:
            global_size, kept, digest, checked = pending.popleft()
            yield WorkerPart(batch if kept else _empty_part(batch), global_size, digest, checked)


class WorkerShuffledBatches:
    """A `ShuffledBatches` whose iteration yields this worker's part of each global batch.

    Position and state are the source's, so backups and resuming mid-epoch work as with the source.
    """

    def __init__(self, source: ShuffledBatches, worker: WorkerRange) -> None:
        self.source = source
        self._worker = worker

    @property
    def num_examples(self) -> int:
        return self.source.num_examples

    @property
    def batch_size(self) -> int:
        return self.source.batch_size

    @property
    def batches_left(self) -> int:
        return self.source.batches_left

    def __len__(self) -> int:
        return len(self.source)

    def set_position(self, epoch: int, offset: int = 0) -> None:
        """The next iteration yields this worker's parts of epoch `epoch`, from batch `offset` on."""
        self.source.set_position(epoch, offset)

    def set_epoch(self, epoch: int) -> None:
        """Start of 0-based `epoch`."""
        self.source.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The source's state (the same on every worker)."""
        return self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues the source from a saved state."""
        self.source.load_state_dict(state)

    def __iter__(self) -> Iterator[WorkerPart]:
        for position, indices in enumerate(self.source.batch_indices()):
            lo, hi = self._worker.bounds(len(indices))
            digest = indices_digest(indices)
            checked = None
            if probe.due(position):
                checked = (int(indices[0]), probe.example_digest(_Batches(self.source), indices[:1]))
            if hi > lo:
                yield WorkerPart(self.source.batch_of(indices[lo:hi]), len(indices), digest, checked)
            else:
                yield WorkerPart(_empty_part(self.source.batch_of(indices[:1])), len(indices), digest, checked)

    def __repr__(self) -> str:
        return f"WorkerShuffledBatches({self.source!r}, {self._worker})"


class _Batches:
    """`source.batch_of` read as a data set is (`probe.example_digest` indexes it)."""

    def __init__(self, source: ShuffledBatches) -> None:
        self.source = source

    def __getitem__(self, indices: Any) -> Any:
        return self.source.batch_of(indices)
