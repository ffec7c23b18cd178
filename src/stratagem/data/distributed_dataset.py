"""`DistributedDataset`: what `Strategy.distribute_dataset` returns, an iterable of one batch per local replica.

Each GLOBAL batch is cut among the replicas' devices (`batches.distribute_batch`); with a replica on a GPU the
next batch is cut, its copies queued on the input streams (`prefetch.py`), before the current one is yielded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from stratagem.data.batch_dims import BatchDimFirst, restore_batch_dim
from stratagem.data.batches import distribute_batch, stack_batch
from stratagem.data.split import batch_size_of, split_batch
from stratagem.values import map_structure


class DistributedDataset:
    """An iterable of distributed batches: each yields one batch per local replica (`PerReplica` leaves).

    `devices()` gives the local replicas' devices, read when the dataset is iterated (a strategy may settle
    them in `distribute`, after the dataset is made). `per_replica`: `dataset` yields one replica's batch at a
    time (`distribute_datasets_from_function`), else GLOBAL batches, cut along `batch_dim`.

    Example:
        >>> dataset = DistributedDataset(lambda: [torch.device("cpu")] * 2, [torch.arange(4)])
        >>> next(iter(dataset)).values
        (tensor([0, 1]), tensor([2, 3]))
    """

    def __init__(
        self,
        devices: Callable[[], Sequence[torch.device]],
        dataset: Iterable[Any],
        per_replica: bool = False,
        batch_dim: int = 0,
    ) -> None:
        self._devices = devices
        self._dataset: Iterable[Any] = dataset if batch_dim == 0 else BatchDimFirst(dataset, batch_dim)
        self._per_replica = per_replica
        self._batch_dim = batch_dim

    def __len__(self) -> int:
        return len(self._dataset)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        if self._batch_dim != 0:
            # Cut along dimension 0 of views with the batch dimension first, each piece moved back (batch_dims.py).
            yield from restore_batch_dim(self._batches(), self._batch_dim)
        else:
            yield from self._batches()

    def _batches(self) -> Iterator[Any]:
        devices = list(self._devices())
        if self._per_replica:
            yield from self._iter_per_replica(devices)
            return
        if not any(d.type == "cuda" for d in devices):
            for step, batch in enumerate(self._dataset):
                yield distribute_batch(batch, devices, step)
            return
        # A replica on a GPU: the next batch is distributed (its copies queued on the input streams, see
        # stratagem.data.prefetch) before the current one is yielded, so it travels while the step computes.
        pending = None
        for step, batch in enumerate(self._dataset):
            ready = distribute_batch(batch, devices, step)
            if pending is not None:
                yield pending
            pending = ready
        if pending is not None:
            yield pending

    def _iter_per_replica(self, devices: list[torch.device]) -> Iterator[Any]:
        iterator = iter(self._dataset)
        step = 0
        while True:
            pieces = []
            for _ in devices:
                try:
                    pieces.append(next(iterator))
                except StopIteration:
                    break
            if not pieces:
                return
            for piece in pieces:
                batch_size_of(piece)
            while len(pieces) < len(devices):
                # The input ran out mid-step: the remaining replicas get empty slices (weight zero).
                pieces.append(map_structure(lambda t: t[:0] if isinstance(t, torch.Tensor) else t, pieces[-1]))
            moved = [split_batch(p, [batch_size_of(p)], [d])[0] for p, d in zip(pieces, devices)]
            yield stack_batch(moved)
            step += 1
