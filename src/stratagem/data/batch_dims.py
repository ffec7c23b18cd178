"""Batches whose examples are not counted along dimension 0: a `(seq, batch)` input, an LSTM's hidden state
`(layers, batch, hidden)`.

The splitting of `split.py` cuts dimension 0. A tensor whose batch dimension is `d` is cut as the view
`t.movedim(d, 0)` and each replica's piece moved back with `piece.movedim(0, d)`: views both ways, so no
example is copied on a CPU, and every other part of the input path (the split among replicas, each
worker's part of the global batch) stays as it is.

A batch dimension is named per argument of a step function (`{"hidden": 1}`) or once for every tensor
(`1`); negative dimensions count from the end, as in torch. `check_batch_sizes` refuses arguments whose
sizes along their batch dimensions differ, naming the argument, its shape and the batch size, before
anything is cut.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Union

import torch

from stratagem.errors import InputError
from stratagem.nest import flatten_with_paths
from stratagem.values import PerReplica, flatten, map_structure

BatchDims = Union[int, Mapping[str, int], None]
"""The batch dimension of every tensor (an int), of each named argument (a mapping; others: 0), or 0 (None)."""


def check_batch_dims(batch_dims: BatchDims, names: Sequence[str] | None = None, *, where: str) -> None:
    """Refuses a batch-dimension spec that is not an int or a mapping of argument names to ints; with `names`,
    a mapping that names an argument the function does not have."""
    if batch_dims is None or _is_int(batch_dims):
        return
    if not isinstance(batch_dims, Mapping) or not all(isinstance(k, str) and _is_int(v) for k, v in batch_dims.items()):
        raise InputError(
            f"{where} takes the batch dimension as an int (every tensor) or a dict of argument names to ints. "
            f"Received: batch_dims={batch_dims!r}. For example batch_dims=1, or batch_dims={{'hidden': 1}}."
        )
    if names is not None:
        unknown = sorted(set(batch_dims) - set(names))
        if unknown:
            raise InputError(
                f"batch_dims names arguments the step function does not have. Received: {unknown} for a function of "
                f"({', '.join(names)}). Use the names of its parameters."
            )


def check_batch_dim(batch_dim: Any) -> None:
    """Refuses a dataset's batch dimension that is not an int."""
    if not _is_int(batch_dim):
        raise InputError(
            f"distribute_dataset's batch_dim is the dimension of every tensor that counts examples, an int. Received: "
            f"batch_dim={batch_dim!r}. Use batch_dim=1 for (seq, batch) batches; for different dimensions per "
            "argument, call a step function made with strategy.step(batch_dims={...})."
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def dim_of(batch_dims: BatchDims, name: str) -> int:
    """The batch dimension of the argument `name`."""
    if batch_dims is None:
        return 0
    if isinstance(batch_dims, Mapping):
        return batch_dims.get(name, 0)
    return batch_dims


def _normalized(path: str, t: torch.Tensor, dim: int) -> int:
    if t.dim() == 0:
        raise InputError(
            f"Every tensor of a global batch needs a batch dimension to cut it among replicas. Received: {path} is a "
            "scalar tensor. Pass scalars to the step function inside a non-tensor value, or as a Python number."
        )
    if not -t.dim() <= dim < t.dim():
        raise InputError(
            f"{path} has no dimension {dim} to cut among replicas. Received: shape {tuple(t.shape)}. Name a batch "
            f"dimension in [-{t.dim()}, {t.dim()}) for it with batch_dims."
        )
    return dim % t.dim()


def check_batch_sizes(named: Mapping[str, Any], batch_dims: BatchDims) -> int | None:
    """The number of examples the tensors of `named` (argument name -> value) hold along their batch dimensions;
    `InputError` naming the first argument that disagrees. None when no argument holds a tensor."""
    first: tuple[str, torch.Tensor, int] | None = None
    for name, value in named.items():
        dim = dim_of(batch_dims, name)
        for path, t in flatten_with_paths(value, name, lambda v: isinstance(v, PerReplica)):
            if not isinstance(t, torch.Tensor):
                continue
            d = _normalized(path, t, dim)
            if first is None:
                first = (path, t, d)
                continue
            first_path, first_t, first_d = first
            if t.shape[d] != first_t.shape[first_d]:
                raise InputError(
                    f"{path} does not hold the batch's number of examples along its batch dimension, so it cannot be "
                    f"cut among replicas with the rest of the batch. Received: {path} of shape {tuple(t.shape)} holds "
                    f"{t.shape[d]} along dimension {d}, and the batch holds {first_t.shape[first_d]} ({first_path} of "
                    f"shape {tuple(first_t.shape)} along dimension {first_d}). Name each argument's batch dimension "
                    f"with batch_dims (for example batch_dims={{{name!r}: 1}} for a (layers, batch, hidden) state), or "
                    "pass a value that every replica should receive whole outside the tensors of the batch (a closure)."
                )
    return None if first is None else int(first[1].shape[first[2]])


def to_front(value: Any, dim: int) -> Any:
    """Every tensor of `value` as a view with its dimension `dim` first (`PerReplica` values, already cut, stay)."""
    if dim == 0:
        return value
    return map_structure(lambda t: t.movedim(dim % t.dim(), 0) if isinstance(t, torch.Tensor) else t, value)


def from_front(cut: Any, dim: int, before: Any = None) -> Any:
    """`cut` (what `to_front(before, dim)` became once cut among replicas: the same nest, its tensors now tensors
    or `PerReplica` values) with the batch dimension of every piece moved back to `dim`. With `before`, leaves
    that were not tensors there (a `PerReplica` handed in already cut) are left as they are."""
    if dim == 0:
        return cut
    moved = None if before is None else iter([isinstance(leaf, torch.Tensor) for leaf in flatten(before)])

    def back(leaf: Any) -> Any:
        if moved is not None and not next(moved):
            return leaf
        if isinstance(leaf, PerReplica):
            return dataclasses.replace(leaf, values=tuple(v.movedim(0, dim % v.dim()) for v in leaf.values))
        if isinstance(leaf, torch.Tensor):
            return leaf.movedim(0, dim % leaf.dim())
        return leaf

    return map_structure(back, cut)


class BatchDimFirst:
    """An iterable of batches with the batch dimension `dim` of every tensor moved first (views)."""

    def __init__(self, dataset: Iterable[Any], dim: int) -> None:
        self.dataset = dataset
        self.dim = dim

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        for batch in self.dataset:
            check_batch_sizes({"batch": batch}, self.dim)
            yield to_front(batch, self.dim)


def restore_batch_dim(distributed: Iterable[Any], dim: int) -> Iterator[Any]:
    """The distributed batches of a `BatchDimFirst` input with every piece's batch dimension moved back to `dim`."""
    for batch in distributed:
        yield from_front(batch, dim)


class BatchDimRestored:
    """A distributed input built over a `BatchDimFirst` input, each piece's batch dimension moved back to `dim`;
    anything else (its length, counters) is the distributed input's."""

    def __init__(self, distributed: Iterable[Any], dim: int) -> None:
        self.distributed = distributed
        self.dim = dim

    def __len__(self) -> int:
        return len(self.distributed)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        return restore_batch_dim(self.distributed, self.dim)

    def __getattr__(self, name: str) -> Any:
        if name in ("distributed", "dim"):
            raise AttributeError(name)
        return getattr(self.distributed, name)
