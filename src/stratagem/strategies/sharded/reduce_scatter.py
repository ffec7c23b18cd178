"""FSDP2's reduce-scatter extension point (`ReduceScatter`), implemented as a SUM of pre-scaled gradients.

A module of its own because it subclasses torch's `ReduceScatter`, so importing it imports
`torch.distributed.fsdp` (over a second of CPU): `weighting.weigh_gradients` imports it when a model is
sharded, not when `import stratagem` runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter


class WeightedReduceScatter(ReduceScatter):
    """A reduce-scatter of SUM that first scales this rank's gradients by `weight` (its share of the batch)."""

    def __init__(self) -> None:
        self.weight = 1.0
        """This rank's weight in the current backward: n_r / N, or c_r / sum c for declared loss weights."""
        self.before_sum: Callable[[], None] | None = None
        """Called before each reduce-scatter is started: the strategy's batch check, waited for before any gradient
        of the step is summed (`agreement.StepAgreement.finish`, which does nothing once it is done)."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> dist.Work | None:
        if self.before_sum is not None:
            self.before_sum()
        if self.weight != 1.0:
            input_tensor.mul_(self.weight)  # FSDP's flat copy of the gradients, not the user's tensors
        return dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op
        )
