"""FSDP2's reduce-scatter extension point (`ReduceScatter`), implemented as a SUM of pre-scaled gradients.

A module of its own because it subclasses torch's `ReduceScatter`, so importing it imports
`torch.distributed.fsdp` (over a second of CPU): `weighting.weigh_gradients` imports it when a model is
sharded, not when `import stratagem` runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

if TYPE_CHECKING:
    from stratagem.strategies.sharded.agreement import StepAgreement


class WeightedReduceScatter(ReduceScatter):
    """A reduce-scatter of SUM that first scales this rank's gradients by `weight` (its share of the batch)."""

    def __init__(self) -> None:
        self.weight = 1.0
        """This rank's weight in the current backward: n_r / N, or c_r / sum c for declared loss weights."""
        self.rider: StepAgreement | None = None
        """The strategy's batch check, whose numbers ride the first reduce-scatter of each step (`_ride`)."""

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
        if self.weight != 1.0:
            input_tensor.mul_(self.weight)  # FSDP's flat copy of the gradients, not the user's tensors
        extra = None if self.rider is None or async_op else self.rider.ride(input_tensor.dtype, input_tensor.device)
        if extra is not None:
            self._ride(output_tensor, input_tensor, group, extra)
            return None
        return dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op
        )

    def _ride(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, extra: torch.Tensor
    ) -> None:
        """The reduce-scatter with `extra` (every rank's slots, this rank's filled) beside each rank's chunk, so that
        every rank's part of the sum ends with every rank's slots summed: one collective where a separate all-reduce
        would add a round trip. FSDP2 lays its input out as one row per rank with no room between them, so the rows
        are copied into a wider buffer (this unit's gradients once, the first unit reduced in the step only)."""
        assert self.rider is not None  # the caller checked
        shard = output_tensor.numel()
        world = input_tensor.numel() // shard
        wide = torch.empty(world, shard + extra.numel(), dtype=input_tensor.dtype, device=input_tensor.device)
        wide[:, :shard].copy_(input_tensor.view(world, shard))
        wide[:, shard:].copy_(extra.expand(world, -1))
        out = torch.empty(shard + extra.numel(), dtype=output_tensor.dtype, device=output_tensor.device)
        dist.reduce_scatter_tensor(out, wide.view(-1), op=dist.ReduceOp.SUM, group=group)
        output_tensor.copy_(out[:shard])
        self.rider.landed(out[shard:])
