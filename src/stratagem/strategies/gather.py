"""`Strategy.gather`: every replica's values, of every worker, in global batch order.

A step over a distributed batch gives replica r the r-th contiguous slice of the global batch
(worker by worker, then replica by replica within a worker), so concatenating the replicas'
values in that order puts predictions and labels back in the order of the global batch:

    preds = strategy.run(lambda x: model(x).argmax(1), args=(x,))
    everything = strategy.gather(preds)          # one tensor: the predictions of the whole global batch

What is gathered, leaf by leaf of a nest of dicts, tuples and lists:
- tensors are concatenated along `axis` (0-dim tensors are stacked, one element per replica);
- Python objects: a list or tuple holding no tensor is a batch of objects, and the batches are
  concatenated into one list; any other object gives a list with one entry per replica.
A `PerReplica` value counts once per replica; any other value is this process's own and counts
once per worker (under one process: once, so `gather` of a plain tensor returns it).
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stratagem.errors import InputError
from stratagem.values import PerReplica, flatten, map_structure, select_replica


def local_items(value: Any, num_local_replicas: int) -> list[Any]:
    """This process's contributions to a gather, in replica order: one per replica, or the value itself."""
    leaves = [value] if isinstance(value, PerReplica) else flatten(value)
    per_replica = [leaf for leaf in leaves if isinstance(leaf, PerReplica)]
    if not per_replica:
        return [value]
    for leaf in per_replica:
        if len(leaf.values) != num_local_replicas:
            raise InputError(
                f"gather received a per-replica value with {len(leaf.values)} values, but this strategy has "
                f"{num_local_replicas} local replica(s). Received: {leaf!r}. Gather the values `run` returned."
            )
    if isinstance(value, PerReplica):
        return list(value.values)
    return [select_replica(value, r) for r in range(num_local_replicas)]


def combine(items: Sequence[Any], axis: int) -> Any:
    """Joins the contributions of every replica (in global order) into one value of the same structure."""
    first = items[0]
    if all(isinstance(item, torch.Tensor) for item in items):
        if first.dim() == 0:
            return torch.stack([item.to(first.device) for item in items])
        if not -first.dim() <= axis < first.dim():
            raise InputError(
                f"gather's axis is out of range for the gathered tensors. Received: axis={axis}, shape="
                f"{tuple(first.shape)}. Use an axis in [{-first.dim()}, {first.dim()})."
            )
        try:
            return torch.cat([item.to(first.device) for item in items], dim=axis)
        except RuntimeError as error:
            raise InputError(
                f"gather cannot concatenate the replicas' tensors along axis {axis}: their other dimensions "
                f"differ. Received: shapes {[tuple(t.shape) for t in items]}. Gather along the dimension "
                "that differs, or pad the values to one shape first."
            ) from error
    if any(isinstance(item, torch.Tensor) for item in items):
        raise InputError(
            "gather received a tensor from some replicas and another kind of value from others at the same "
            f"place. Received: {[type(item).__name__ for item in items]}. Return the same structure from every replica."
        )
    if not any(isinstance(leaf, torch.Tensor) for item in items for leaf in flatten(item)):
        if all(isinstance(item, (list, tuple)) and not hasattr(item, "_fields") for item in items):
            return list(itertools.chain.from_iterable(items))  # batches of Python objects, joined in order
        if not isinstance(first, (dict, tuple)):
            return list(items)
    if isinstance(first, dict):
        if any(not isinstance(item, dict) or item.keys() != first.keys() for item in items):
            raise _mismatch(items)
        return type(first)((key, combine([item[key] for item in items], axis)) for key in first)
    if isinstance(first, (tuple, list)):
        if any(not isinstance(item, (tuple, list)) or len(item) != len(first) for item in items):
            raise _mismatch(items)
        columns = [combine(list(column), axis) for column in zip(*items)]
        if hasattr(first, "_fields"):
            return type(first)(*columns)
        return type(first)(columns)
    return list(items)


def _mismatch(items: Sequence[Any]) -> InputError:
    return InputError(
        "gather needs the same structure (the same dict keys, the same tuple lengths) from every replica. "
        f"Received: {[_describe(item) for item in items]}. Return the same structure from every replica."
    )


def _describe(item: Any) -> str:
    if isinstance(item, dict):
        return f"dict with keys {sorted(map(str, item))}"
    if isinstance(item, (tuple, list)):
        return f"{type(item).__name__} of {len(item)}"
    return type(item).__name__


def to_bytes(items: list[Any]) -> bytes:
    """Serializes this worker's contributions for the trip to the other workers (tensors moved to the CPU)."""

    def to_cpu(leaf: Any) -> Any:
        return leaf.detach().cpu() if isinstance(leaf, torch.Tensor) else leaf

    buffer = io.BytesIO()
    torch.save([map_structure(to_cpu, item) for item in items], buffer)
    return buffer.getvalue()


def from_bytes(payload: bytes, who: str) -> list[Any]:
    """Reads another worker's contributions back; only tensors and plain Python values are accepted."""
    try:
        # weights_only: what travels is tensors, numbers, strings, lists, tuples and dicts, never code.
        return torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as error:  # noqa: BLE001 - reported with what to do
        raise InputError(
            f"gather could not read the values {who} sent: only tensors, numbers, strings, lists, tuples and "
            f"dicts travel between workers. Received: {str(error).splitlines()[0][:200]}. Convert other objects "
            "(dataclasses, custom classes) to those first."
        ) from None


def gather_values(
    value: Any,
    axis: int,
    num_local_replicas: int,
    across_workers: Callable[[list[Any]], list[Any]],
    device: torch.device,
) -> Any:
    """The whole of `gather`: local contributions, then every worker's (in rank order), then joined."""
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise InputError(f"gather's axis must be an int. Received: axis={axis!r}. Use e.g. axis=0.")
    items = across_workers(local_items(value, num_local_replicas))
    with torch.no_grad():  # a gathered value is a report, not part of the graph
        moved = [_to_device(item, device) for item in items]
        return combine(moved, axis)


def _to_device(item: Any, device: torch.device) -> Any:
    return map_structure(lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, item)
