"""What `run` reads from its per-replica arguments: how the global batch was split, and each replica's weight.

A `PerReplica` argument made by `distribute_dataset` carries the sizes of its slices and the size of
the global batch they came from; every such argument of one `run` must agree. Each local replica's
gradient is weighted by its share of the global batch (equal shares when no argument says how the
batch was split), so the weighted sum is the gradient of the mean loss over the whole global batch.

A tensor handed to `run` that no `distribute_dataset` or `strategy.step` cut reaches every replica whole.
That is right for a constant (a mask, class weights) and wrong for a batch: the loss still looks right,
but every replica does the whole batch's work (841 against 504 ms per step, issue 29). `warn_whole_tensors`
says so once per argument where one process runs several replicas, unless the tensor was marked with
`replicated`.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from typing import Any

import torch

from stratagem.errors import InputError
from stratagem.nest import flatten_with_paths
from stratagem.values import PerReplica, flatten, map_structure

_marked_replicated: dict[int, weakref.ref[torch.Tensor]] = {}
"""The tensors marked with `replicated`, by id; an entry leaves with its tensor."""


def replicated(value: Any) -> Any:
    """Marks every tensor of `value` (a tensor or a nest of them) as meant to reach every replica of
    `strategy.run` whole, so that run does not warn about it; returns `value` itself, unchanged.

    Example:
        >>> class_weights = sg.replicated(torch.tensor([1.0, 3.0]))   # the same for every replica
        >>> strategy.run(step, args=(x, y, class_weights))             # x, y from distribute_dataset
    """

    def mark(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            key = id(leaf)
            _marked_replicated[key] = weakref.ref(leaf, functools.partial(_forget, key))
        return leaf

    map_structure(mark, value)
    return value


def _forget(key: int, _: object) -> None:
    _marked_replicated.pop(key, None)


def _is_marked(t: torch.Tensor) -> bool:
    ref = _marked_replicated.get(id(t))
    return ref is not None and ref() is t


def warn_whole_tensors(args: tuple, kwargs: dict, num_local_replicas: int, warned: set[str]) -> None:
    """Warns once per argument (its path, recorded in `warned`) about a tensor that reaches every one of this
    process's several replicas whole: not cut by distribute_dataset or strategy.step, not marked with
    `replicated`. With one replica per process nothing is said: each worker's replica receives that worker's
    tensor, which may be its own part of the batch (a loader sharded by the user)."""
    if num_local_replicas < 2:
        return
    is_per_replica = lambda v: isinstance(v, PerReplica)  # noqa: E731
    leaves = flatten_with_paths(args, "args", is_per_replica) + flatten_with_paths(kwargs, "kwargs", is_per_replica)
    for path, leaf in leaves:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or path in warned or _is_marked(leaf):
            continue
        warned.add(path)
        warnings.warn(
            f"strategy.run received {path}, a tensor of shape {tuple(leaf.shape)} that no distribute_dataset or "
            f"strategy.step cut among the replicas, so each of the {num_local_replicas} replicas receives it whole: "
            "if it is a batch, every replica computes on every example (the loss looks right, but each replica does "
            "the whole batch's work). Cut batches with strategy.distribute_dataset(loader), or call the step "
            "function through strategy.step(fn), which cuts its tensor arguments; if every replica is meant to "
            "receive this tensor whole, mark it with sg.replicated(tensor).",
            UserWarning,
            stacklevel=4,  # this function, ReplicaSet.run, the strategy's run, the caller
        )


def global_size(args: tuple, kwargs: dict) -> int | None:
    """The size of the global batch the per-replica arguments were cut from (None: not known)."""
    for leaf in flatten((args, kwargs)):
        if isinstance(leaf, PerReplica) and leaf.global_size is not None:
            return leaf.global_size
    return None


def batch_sizes(args: tuple, kwargs: dict, num_replicas: int) -> tuple[int, ...] | None:
    """The sizes of the local replicas' slices (None: no argument says); refuses arguments that disagree."""
    sizes = None
    for leaf in flatten((args, kwargs)):
        if isinstance(leaf, PerReplica):
            if len(leaf.values) != num_replicas:
                raise InputError(
                    f"A per-replica value has {len(leaf.values)} values but this strategy has {num_replicas} "
                    "replicas. Distribute the input with this strategy's distribute_dataset."
                )
            if leaf.batch_sizes is not None:
                if sizes is not None and leaf.batch_sizes != sizes:
                    raise InputError(
                        "The per-replica arguments of run() come from batches split differently. "
                        f"Received: batch sizes {sizes} and {leaf.batch_sizes}. Pass pieces of one distributed batch."
                    )
                sizes = leaf.batch_sizes
    return sizes


def replica_weights(
    sizes: tuple[int, ...] | None, total_size: int | None, num_local: int, num_replicas_in_sync: int
) -> list[float]:
    """Each local replica's share of the global batch (equal shares when the batch is unknown)."""
    if sizes is None:
        return [1.0 / num_replicas_in_sync] * num_local
    total = total_size if total_size is not None else sum(sizes)
    return [n / total for n in sizes]


def device_guard(device: torch.device) -> Any:
    """The replica's GPU as the current device while its step runs (nothing to do on the CPU)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
