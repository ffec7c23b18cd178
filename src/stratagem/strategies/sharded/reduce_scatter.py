"""FSDP2's collective extension points (`AllGather`, `ReduceScatter`): a reduce-scatter of SUM over pre-scaled
gradients, and both collectives through one host's shared memory when the strategy connected it (transport.py).

A module of its own because it subclasses torch's `ReduceScatter`, so importing it imports
`torch.distributed.fsdp` (over a second of CPU): `weighting.weigh_gradients` imports it when a model is
sharded, not when `import stratagem` runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

if TYPE_CHECKING:
    from stratagem.shm.sums import SharedMemoryGroup


class WeightedReduceScatter(ReduceScatter):
    """A reduce-scatter of SUM that first scales this rank's gradients by `weight` (its share of the batch).

    Through `shared` (every worker on this host) when it takes the tensors, else through the process group;
    `step` names the step in a shared-memory wait's error."""

    def __init__(self, shared: SharedMemoryGroup | None = None, step: Callable[[], int] = lambda: 0) -> None:
        self.weight = 1.0
        """This rank's weight in the current backward: n_r / N, or c_r / sum c for declared loss weights."""
        self.shared = shared
        self.step = step

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
        shared = self.shared
        if shared is not None and shared.supports(input_tensor) and shared.supports(output_tensor):
            what = "reduce-scatter of gradients"  # weighted on their way into the shared file: one pass less
            shared.reduce_scatter_(output_tensor, input_tensor, what=what, step=self.step(), scale=self.weight)
            return None  # done: FSDP2 waits only on a returned handle
        if self.weight != 1.0:
            input_tensor.mul_(self.weight)  # FSDP's flat copy of the gradients, not the user's tensors
        return dist.reduce_scatter_single(
            output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op
        )


class SharedMemoryAllGather(AllGather):
    """FSDP2's all-gather of a unit's shards through one host's shared memory (the process group for tensors it
    does not take: not on the CPU, or not contiguous)."""

    def __init__(self, shared: SharedMemoryGroup, step: Callable[[], int]) -> None:
        self.shared = shared
        self.step = step

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        if _on_host(output_tensor) and _on_host(input_tensor):
            self.shared.all_gather_into_(output_tensor, input_tensor, what="all-gather of parameters", step=self.step())
            return None
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def _on_host(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.is_contiguous()
