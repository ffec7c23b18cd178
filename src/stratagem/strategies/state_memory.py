"""The bytes of one rank's training state, whatever splits it: the parts every memory plan shares.

A plan (ShardedStrategy's `sharded/memory.py`, TensorParallelStrategy's `tensor_parallel/memory.py`,
MultiWorkerMirrored's `memory_fit.replicated_plan`) first works out the bytes of this rank's part of each parameter
(`mine`, by parameter id: a shard, a split, or the whole tensor); the optimizer state and the step's temporaries
follow from it by the optimizer's class, as here:

- optimizer state: k * mine plus the per-parameter step counters, k = the state tensors the optimizer keeps per
  parameter (SGD with momentum 1, Adagrad 1, Adam and AdamW 2, 3 with amsgrad, ...); None for an optimizer this
  does not know;
- optimizer temporaries: torch's per-parameter Adam(W), RMSprop and the like build a denominator of the largest
  part (two tensors of it at once); 0 for SGD.

    >>> optimizer_state_bytes(torch.optim.AdamW(params), {id(p): 800 for p in params})    # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

# State tensors shaped like the parameter, per optimizer class (torch's own optimizers).
_STATE_TENSORS: dict[str, Any] = {
    "SGD": lambda g: 1 if g.get("momentum", 0) else 0,
    "Adam": lambda g: 3 if g.get("amsgrad") else 2,
    "AdamW": lambda g: 3 if g.get("amsgrad") else 2,
    "Adamax": lambda g: 2,
    "NAdam": lambda g: 2,
    "RAdam": lambda g: 2,
    "Adadelta": lambda g: 2,
    "Adagrad": lambda g: 1,
    "RMSprop": lambda g: 1 + (1 if g.get("momentum", 0) else 0) + (1 if g.get("centered") else 0),
}
# Optimizers whose per-parameter step allocates a denominator (sqrt of the second moment) beside the state.
_DENOMINATOR = {"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta"}
# Optimizers that keep a step counter per parameter, a 0-dim float32 tensor.
_STEP_TENSOR = {"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adadelta", "Adagrad", "RMSprop"}


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None, mine: dict[int, int]) -> int | None:
    """The optimizer's state on this rank after its first step, for parts of `mine` bytes per parameter id (0 with
    no optimizer; None for an optimizer class this does not know)."""
    if optimizer is None:
        return 0
    name = type(optimizer).__name__
    per_param = _STATE_TENSORS.get(name)
    if per_param is None or type(optimizer).__module__.split(".")[:2] != ["torch", "optim"]:
        return None
    total = 0
    for group in optimizer.param_groups:
        k = per_param(group)
        for p in group["params"]:
            if not p.requires_grad:
                continue
            total += k * mine.get(id(p), 0)
            if name in _STEP_TENSOR:
                total += 4  # the 0-dim float32 step counter every rank keeps whole
    return total


def optimizer_temporaries(optimizer: torch.optim.Optimizer | None, mine: dict[int, int]) -> int:
    """Two tensors of the largest part for the optimizers whose per-parameter step builds a denominator."""
    if optimizer is None or type(optimizer).__name__ not in _DENOMINATOR:
        return 0
    return 2 * max((mine.get(id(p), 0) for g in optimizer.param_groups for p in g["params"]), default=0)


def measured_local_bytes(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank holds now: its local parts of parameters, gradients and optimizer state, in bytes."""

    def local(t: torch.Tensor) -> int:
        inner = t.to_local() if hasattr(t, "to_local") else t
        return inner.numel() * inner.element_size()

    params = list(params)
    state = sum(local(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {
        "parameters": sum(local(p) for p in params),
        "gradients": sum(local(p.grad) for p in params if p.grad is not None),
        "optimizer_state": state,
    }


def chunk_size(size: int, parts: int, index: int) -> int:
    """The length `index` holds of a dimension of `size` cut in `parts` as torch.chunk, FSDP2 and DTensor's
    `Shard` cut it: ceil(size / parts) each, the last ones short or empty."""
    chunk = math.ceil(size / parts) if size else 0
    return max(0, min(chunk, size - index * chunk))


def show_bytes(n: int) -> str:
    """`n` bytes for a reader: B under a KiB, KiB under a MiB, else MiB."""
    if n < 1024:
        return f"{n} B"
    if n < 2**20:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 2**20:.2f} MiB"
