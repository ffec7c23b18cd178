"""Splitting a global batch among replicas.

A global batch of `n` examples is cut into contiguous slices whose sizes differ by at most one,
the first replicas taking the extra examples (4 over 3 replicas: 2, 1, 1; tf.distribute gives
2, 2, 0). A replica whose slice is empty still takes part in every step, with weight zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stratagem.data.prefetch import copy_to_device
from stratagem.errors import InputError
from stratagem.nest import flatten_with_paths
from stratagem.values import PerReplica, map_structure


def split_sizes(num_examples: int, num_replicas: int) -> list[int]:
    """Sizes of the replicas' slices: as even as possible, the first ones larger.

    >>> split_sizes(10, 3)
    [4, 3, 3]
    """
    if num_replicas < 1:
        raise InputError(f"num_replicas must be at least 1. Received: num_replicas={num_replicas}.")
    base, extra = divmod(num_examples, num_replicas)
    return [base + (1 if r < extra else 0) for r in range(num_replicas)]


def replica_part(batch: Any, num_replicas: int, replica: int) -> Any:
    """Replica `replica`'s contiguous slice of a global `batch` (views of its tensors, no copy), as a step cuts it.

    >>> replica_part(torch.arange(13), 2, 1)
    tensor([ 7,  8,  9, 10, 11, 12])
    """
    if not any(isinstance(leaf, torch.Tensor) for _, leaf in flatten_with_paths(batch)):
        return batch
    sizes = split_sizes(batch_size_of(batch), num_replicas)
    start = sum(sizes[:replica])
    return map_structure(lambda t: t[start : start + sizes[replica]] if isinstance(t, torch.Tensor) else t, batch)


def batch_size_of(batch: Any) -> int:
    """The first dimension shared by every tensor of a batch; raises `InputError` if they disagree.

    A batch is any nest (`stratagem.nest`): tuples, lists, named tuples, dataclasses, dicts and
    other `Mapping`s such as Hugging Face's `BatchEncoding`. Leaves that are not tensors (strings,
    numbers) are not split: every replica receives them unchanged.
    """
    # A PerReplica leaf (a step's per-replica result handed back) is already cut: it is not part of the batch.
    leaves = flatten_with_paths(batch, "batch", lambda v: isinstance(v, PerReplica))
    tensors = [(path, t) for path, t in leaves if isinstance(t, torch.Tensor)]
    if not tensors:
        raise InputError(
            "A batch must contain at least one tensor (a tensor, or a tuple, list, dict, Mapping or dataclass "
            f"holding tensors). Received: a batch of type {type(batch).__name__} with no tensor in it."
        )
    scalars = [path for path, t in tensors if t.dim() == 0]
    if scalars:
        raise InputError(
            "Every tensor of a batch needs a first (batch) dimension to split it among replicas. "
            f"Received: {scalars[0]} is a scalar tensor (shapes {[tuple(t.shape) for _, t in tensors]}). "
            "Give scalars to `run` as separate arguments instead of inside the batch."
        )
    first_path, first = tensors[0]
    for path, t in tensors[1:]:
        if t.shape[0] != first.shape[0]:
            raise InputError(
                "The tensors of a batch disagree in their first (batch) dimension, so the batch cannot be "
                f"split among replicas. Received: {path} holds {t.shape[0]} examples and {first_path} holds "
                f"{first.shape[0]} (shapes {[tuple(x.shape) for _, x in tensors]}). Make every tensor of a batch "
                "hold the same number of examples, or pass the odd one to `run` as a separate argument."
            )
    return int(first.shape[0])


def split_batch(batch: Any, sizes: Sequence[int], devices: Sequence[torch.device]) -> list[Any]:
    """Cuts `batch` into contiguous slices of `sizes`, each moved to its replica's device.

    On a CPU the slices are views: no example is copied.
    """
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    out = []
    for r, device in enumerate(devices):
        lo, hi = bounds[r], bounds[r + 1]

        def take(leaf: Any, lo: int = lo, hi: int = hi, device: torch.device = device) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            piece = leaf[lo:hi]
            if piece.device != device:
                # From pinned memory to a GPU on a side stream, overlapping the step that computes meanwhile.
                piece = copy_to_device(piece, device)
            return piece

        out.append(map_structure(take, batch))
    return out


@dataclass(frozen=True, kw_only=True)
class InputContext:
    """What an input function needs to know to build its part of the input (tf.distribute's InputContext).

    Example:
        >>> def dataset_fn(ctx: sg.InputContext):
        ...     batch = ctx.get_per_replica_batch_size(64)
        ...     return DataLoader(shard(data, ctx.input_pipeline_id, ctx.num_input_pipelines), batch_size=batch)
    """

    num_input_pipelines: int = 1
    """How many input pipelines there are (one per worker process)."""
    input_pipeline_id: int = 0
    """Which of them this one is, in [0, num_input_pipelines)."""
    num_replicas_in_sync: int = 1
    """How many replicas take part in each step, across every worker."""

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The batch each replica should read for a given global batch size."""
        if global_batch_size % self.num_replicas_in_sync:
            raise InputError(
                f"The global batch size ({global_batch_size}) is not divisible by the number of replicas "
                f"in sync ({self.num_replicas_in_sync}). Choose a global batch size that is a multiple of "
                f"{self.num_replicas_in_sync}, or use distribute_dataset, which splits any batch."
            )
        return global_batch_size // self.num_replicas_in_sync
