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
    from stratagem.collective.flight import FlightRecord
    from stratagem.shm.sums import SharedMemoryGroup
    from stratagem.strategies.worker_group.step_agreement import StepAgreement


class WeightedReduceScatter(ReduceScatter):
    """A reduce-scatter of SUM that first scales this rank's gradients by `weight` (its share of the batch).

    Through `shared` (every worker on this host) when it takes the tensors, else through the process group;
    `step` names the step in a shared-memory wait's error."""

    def __init__(
        self,
        shared: SharedMemoryGroup | None = None,
        step: Callable[[], int] = lambda: 0,
        flight: FlightRecord | None = None,
    ) -> None:
        self.flight = flight
        """The worker's record of its last collectives (`collective/flight.py`), kept when set."""
        self.weight = 1.0
        """This rank's weight in the current backward: n_r / N, or c_r / sum c for declared loss weights."""
        self.shared = shared
        self.step = step
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
        flown = _enter(self.flight, "reduce_scatter", "reduce-scatter of gradients", self.step, input_tensor)
        work = self._reduce_scatter(output_tensor, input_tensor, group, async_op)
        if flown is not None and work is None:
            self.flight.done(flown)  # type: ignore[union-attr]
        return work

    def _reduce_scatter(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool
    ) -> dist.Work | None:
        extra = None if self.rider is None or async_op else self.rider.ride(input_tensor.dtype, input_tensor.device)
        shared = self.shared
        if shared is not None and not (shared.supports(input_tensor) and shared.supports(output_tensor)):
            shared = None
        if shared is not None and extra is None:
            what = "reduce-scatter of gradients"  # weighted on their way into the shared file: one pass less
            shared.reduce_scatter_(output_tensor, input_tensor, what=what, step=self.step(), scale=self.weight)
            return None  # done: FSDP2 waits only on a returned handle
        if self.weight != 1.0:
            input_tensor.mul_(self.weight)  # FSDP's flat copy of the gradients, not the user's tensors
        if extra is not None:
            self._ride(output_tensor, input_tensor, group, extra, shared)
            return None
        if _through_gloo(input_tensor, group):
            _all_to_all_sum(output_tensor, input_tensor, group)
            return None
        return dist.reduce_scatter_single(
            output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op
        )

    def _ride(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        extra: torch.Tensor,
        shared: SharedMemoryGroup | None,
    ) -> None:
        """The reduce-scatter with `extra` (every rank's slots, this rank's filled) beside each rank's chunk, so that
        every rank's part of the sum ends with every rank's slots summed: one collective where a separate all-reduce
        would add a round trip. FSDP2 lays its input out as one row per rank with no room between them, so the rows
        are copied into a wider buffer (this unit's gradients once, the first unit reduced in the step only). The
        gradients are weighted by now, the slots not; through `shared` where it takes them, else the group."""
        assert self.rider is not None  # the caller checked
        shard = output_tensor.numel()
        world = input_tensor.numel() // shard
        wide = torch.empty(world, shard + extra.numel(), dtype=input_tensor.dtype, device=input_tensor.device)
        wide[:, :shard].copy_(input_tensor.view(world, shard))
        wide[:, shard:].copy_(extra.expand(world, -1))
        out = torch.empty(shard + extra.numel(), dtype=output_tensor.dtype, device=output_tensor.device)
        if shared is not None:
            shared.reduce_scatter_(out, wide.view(-1), what="reduce-scatter of gradients", step=self.step())
        elif _through_gloo(wide, group):
            _all_to_all_sum(out, wide.view(-1), group)
        else:
            dist.reduce_scatter_single(out, wide.view(-1), op=dist.ReduceOp.SUM, group=group)
        output_tensor.copy_(out[:shard])
        self.rider.landed(out[shard:])


class SharedMemoryAllGather(AllGather):
    """FSDP2's all-gather of a unit's shards through one host's shared memory (the process group for tensors it
    does not take: not on the CPU, or not contiguous)."""

    def __init__(self, shared: SharedMemoryGroup, step: Callable[[], int], flight: FlightRecord | None = None) -> None:
        self.shared = shared
        self.step = step
        self.flight = flight

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
            flown = _enter(self.flight, "all_gather", "all-gather of parameters", self.step, input_tensor)
            self.shared.all_gather_into_(output_tensor, input_tensor, what="all-gather of parameters", step=self.step())
            if flown is not None:
                self.flight.done(flown)  # type: ignore[union-attr]
            return None
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def _enter(
    flight: FlightRecord | None, op: str, what: str, step: Callable[[], int], tensor: torch.Tensor
) -> int | None:
    """The collective entered in `flight` (its sequence number), when there is one."""
    if flight is None:
        return None
    return flight.enter(op, what, step(), tensor.nbytes, "shared memory" if _on_host(tensor) else "process group")


def _through_gloo(tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
    return tensor.device.type == "cpu" and dist.get_backend(group) == "gloo"


def _all_to_all_sum(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """A reduce-scatter of SUM from what Gloo does well. Gloo's reduce-scatter all-reduces the whole input and keeps
    one chunk, so every rank moves and sums every chunk; here each rank sends chunk r to rank r (one all-to-all)
    and sums the rows it received, in rank order: half the bytes and 1/N of the additions: 0.55x the wall time and
    CPU of Gloo's own on 16 MiB of float32 between 2 processes (benchmarks/gloo_reduce_scatter.py). Costs one
    input-sized buffer for the rows received, counted in the memory plan."""
    world = input_tensor.numel() // output_tensor.numel()
    rows = torch.empty_like(input_tensor)
    dist.all_to_all_single(rows, input_tensor, group=group)
    torch.sum(rows.view(world, -1), dim=0, out=output_tensor.view(-1))


def _on_host(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.is_contiguous()
