"""Global batches before a strategy takes them: the checks of an input and of a `shard=` policy, and the cut of
one global batch among the replicas of a process (`PerReplica` leaves)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from stratagem.data.split import batch_size_of, split_batch, split_sizes
from stratagem.errors import InputError
from stratagem.values import PerReplica, flatten, map_structure

SHARD_POLICIES = ("auto", "file", "data", "off")
"""How `distribute_dataset(shard=...)` may divide an input among workers."""


def check_shard_policy(shard: Any) -> None:
    """Refuses a `shard=` that is not one of SHARD_POLICIES."""
    if shard not in SHARD_POLICIES:
        raise InputError(f"Unknown shard policy. Received: shard={shard!r}. Use one of {SHARD_POLICIES}.")


def check_iterable(dataset: Any, where: str) -> None:
    """Refuses an input that is not an iterable of batches (a tensor, a string, a mapping)."""
    if isinstance(dataset, (torch.Tensor, str, bytes, Mapping)) or not isinstance(dataset, Iterable):
        raise InputError(
            f"{where} needs an iterable of batches (a DataLoader, a list of (x, y) tuples, a generator...). "
            f"Received: {type(dataset).__name__}. Wrap tensors in a DataLoader, e.g. "
            "DataLoader(TensorDataset(x, y), batch_size=64)."
        )


def distribute_batch(batch: Any, devices: Sequence[torch.device], step: int = 0) -> Any:
    """Cuts one global batch among `devices`; a single device gets the batch itself (moved)."""
    try:
        size = batch_size_of(batch)
    except InputError as error:
        raise InputError(f"Batch {step} of the dataset cannot be distributed: {error}") from None
    if size == 0:
        raise InputError(
            f"Batch {step} of the dataset holds no examples, so there is nothing to train on. "
            "Drop empty batches from the input."
        )
    sizes = split_sizes(size, len(devices))
    pieces = split_batch(batch, sizes, devices)
    if len(devices) == 1:
        return pieces[0]
    return stack_batch(pieces)


def stack_batch(pieces: Sequence[Any]) -> Any:
    """One batch per replica -> one batch whose tensors are `PerReplica` values with batch sizes."""
    sizes = tuple(batch_size_of(p) for p in pieces)
    columns = iter(zip(*[flatten(p) for p in pieces]))

    def make(leaf: Any) -> Any:
        column = next(columns)
        if isinstance(leaf, torch.Tensor):
            return PerReplica(tuple(column), sizes)
        return leaf

    return map_structure(make, pieces[0])
