"""Loaders that torch's `DistributedSampler` has already cut per worker, as DDP scripts build them.

A DDP script gives each process a DataLoader whose `DistributedSampler` yields that process's 1/N of
the data; its `batch_size` is the batch of one process. Ported to MultiWorkerMirroredStrategy with
the default `shard="data"`, such a loader must not be cut again (each worker would train on 1/N^2
of the data): it is read as this worker's own part, and a step's global batch is every worker's
batch together, in rank order, as under DDP. Its batches travel as `WorkerBatch`es; the workers sum
their sizes at every step (the per-step agreement of `shard="off"`), so every replica is weighted by
its share of the true global batch, whatever each worker's batch holds.

A sampler built for another cluster (another `num_replicas` or `rank` than the workers') would read
examples no worker or two workers read; it is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from stratagem.errors import InputError

PER_WORKER = "each worker's own loader"


@dataclass(frozen=True)
class WorkerBatch:
    """One batch of this worker's own loader: its part of a global batch whose size the workers sum."""

    batch: Any


def distributed_sampler_of(data: Any) -> DistributedSampler | None:
    """The `DistributedSampler` of a DataLoader, as its sampler or inside its batch sampler; else None."""
    if not isinstance(data, DataLoader):
        return None
    for sampler in (data.sampler, getattr(data.batch_sampler, "sampler", None)):
        if isinstance(sampler, DistributedSampler):
            return sampler
    return None


def per_worker_loader(
    loader: DataLoader, sampler: DistributedSampler, num_workers: int, rank: int
) -> tuple["PerWorkerLoader", tuple[str, str]]:
    """`loader` read as worker `rank`'s own part, and the ("input sharding" choice, why) for `explain()`.

    Raises:
        InputError: the sampler splits the data among other processes than the `num_workers` workers.
    """
    if (sampler.num_replicas, sampler.rank) != (num_workers, rank):
        raise InputError(
            f"The DataLoader's DistributedSampler splits the data among {sampler.num_replicas} processes and reads "
            f"the part of rank {sampler.rank}, but this job has {num_workers} workers and this one is rank {rank}. "
            f"Received: DistributedSampler(num_replicas={sampler.num_replicas}, rank={sampler.rank}). Build it after "
            "the strategy, with num_replicas and rank left unset (they are then the workers'), or drop it: with "
            "shard='data' each worker reads its own part of every global batch of a plain DataLoader."
        )
    why = (
        f"the DataLoader's DistributedSampler gives each worker its own 1/{num_workers} of the data, so each "
        "worker trains on its loader's batches whole and a step's global batch is every worker's batch together "
        "(its batch_size is one worker's, as under DDP); the workers sum their batch sizes at each step"
    )
    return PerWorkerLoader(loader), (PER_WORKER, why)


def is_per_worker(data: Any) -> bool:
    """Whether `data` yields `WorkerBatch`es: a `PerWorkerLoader`, or a list of its batches (fit's accumulation)."""
    return isinstance(data, PerWorkerLoader) or (
        isinstance(data, list) and bool(data) and isinstance(data[0], WorkerBatch)
    )


class PerWorkerLoader:
    """A DataLoader with a DistributedSampler, its batches this worker's own (each yielded as a `WorkerBatch`).

    Its length, data set, sampler and batch size are the loader's; `set_epoch` reaches the DistributedSampler
    wherever it sits (a new order each epoch, as under DDP).
    """

    def __init__(self, loader: DataLoader) -> None:
        self.original = loader

    @property
    def dataset(self) -> Any:
        return self.original.dataset

    @property
    def sampler(self) -> Any:
        return self.original.sampler

    @property
    def batch_size(self) -> int | None:
        return self.original.batch_size

    def set_epoch(self, epoch: int) -> None:
        """Start of 0-based `epoch`: the DistributedSampler's order for that epoch."""
        sampler = distributed_sampler_of(self.original)
        if sampler is not None:
            sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.original)

    def __iter__(self) -> Iterator[WorkerBatch]:
        for batch in self.original:
            yield WorkerBatch(batch)

    def __repr__(self) -> str:
        return f"PerWorkerLoader({self.original!r})"
