"""What ShardedStrategy refuses before it builds anything, each with the reason and the fix."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from stratagem.errors import InputError

STAGES = (2, 3)

# Optimizers whose step reads whole tensors (a line search over the flattened parameters), which a
# rank holding 1/N of every parameter cannot compute.
_WHOLE_TENSOR_OPTIMIZERS = (torch.optim.LBFGS,)


def check_stage(stage: object) -> int:
    """`stage` as 2 or 3, refused otherwise."""
    if isinstance(stage, bool) or stage not in STAGES:
        raise InputError(
            f"ShardedStrategy shards at stage 2 or 3. Received: stage={stage!r}. Use stage=3 (parameters gathered "
            "per unit for forward and again for backward) or stage=2 (kept gathered from forward to backward)."
        )
    return int(stage)  # type: ignore[call-overload]


def check_optimizer(optimizer: torch.optim.Optimizer | None) -> None:
    """Refuses an optimizer that needs whole tensors, or one that has already stepped (its state is not sharded)."""
    if optimizer is None:
        return
    if isinstance(optimizer, _WHOLE_TENSOR_OPTIMIZERS):
        raise InputError(
            f"{type(optimizer).__name__} needs every parameter whole at each step (its line search runs over the "
            "flattened parameters), but under ShardedStrategy each rank holds 1/N of each. "
            f"Received: {type(optimizer).__name__}. Use an element-wise optimizer (SGD, Adam, AdamW, Adagrad), "
            "or MultiWorkerMirroredStrategy for LBFGS."
        )
    if any(state for state in optimizer.state.values()):
        raise InputError(
            "ShardedStrategy builds the optimizer's state on the shards, so the optimizer must not have stepped "
            f"yet. Received: {type(optimizer).__name__} holding state for {len(optimizer.state)} parameter(s). "
            "Call distribute() before the first optimizer.step()."
        )


def check_device(placed: Iterable[tuple[str, torch.device]], backend: str) -> None:
    """Refuses CUDA parameters (name, device) on a Gloo group, rather than moving them to the CPU behind the
    user's back or failing inside the first backward's reduce-scatter."""
    cuda = [name for name, device in placed if device.type == "cuda"]
    if cuda and backend == "gloo":
        raise InputError(
            "ShardedStrategy's process group uses Gloo, which does not reduce-scatter CUDA tensors. "
            f"Received: CUDA parameters ({cuda[0]}, ...) on a Gloo group. Pass device='cuda' so the group uses "
            "NCCL, or keep the model on the CPU."
        )
