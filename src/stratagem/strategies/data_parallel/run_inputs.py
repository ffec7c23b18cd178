"""What `run` reads from its per-replica arguments: how the global batch was split, and each replica's weight.

A `PerReplica` argument made by `distribute_dataset` carries the sizes of its slices and the size of
the global batch they came from; every such argument of one `run` must agree. Each local replica's
gradient is weighted by its share of the global batch (equal shares when no argument says how the
batch was split), so the weighted sum is the gradient of the mean loss over the whole global batch.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from stratagem.errors import InputError
from stratagem.values import PerReplica, flatten


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
