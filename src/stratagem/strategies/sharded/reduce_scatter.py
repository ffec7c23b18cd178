"""FSDP2's collective extension points (`AllGather`, `ReduceScatter`): a reduce-scatter of SUM over pre-scaled
gradients, and both collectives through one host's shared memory when the strategy connected it (transport.py).

A module of its own because it subclasses torch's `ReduceScatter`, so importing it imports
`torch.distributed.fsdp` (over a second of CPU): `weighting.weigh_gradients` imports it when a model is
sharded, not when `import stratagem` runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

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
        may_defer: Callable[[], bool] = lambda: False,
    ) -> None:
        self.flight = flight
        """The worker's record of its last collectives (`collective/flight.py`), kept when set."""
        self.weight = 1.0
        """This rank's weight in the current backward: n_r / N, or c_r / sum c for declared loss weights."""
        self.shared = shared
        self.step = step
        self.rider: StepAgreement | None = None
        """The strategy's batch check, whose numbers ride the first reduce-scatter of each step (`_ride`)."""
        self.may_defer = may_defer
        """Asked at a backward's first reduce-scatter: whether its reduce-scatters through Gloo may end later in the
        backward (`_Deferred`); `weighting.no_gradient_read_in_backward` says yes when no gradient exists yet."""
        self._deferred = _Deferred()

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
        # Decided at a backward's first reduce-scatter through Gloo, before it leaves a gradient; the other paths
        # end every reduce-scatter where it is called and pay nothing for it.
        defer = self.shared is None and _through_gloo(input_tensor, group) and self._deferred.decide(self.may_defer)
        flown = _enter(self.flight, "reduce_scatter", "reduce-scatter of gradients", self.step, input_tensor)
        work = self._reduce_scatter(output_tensor, input_tensor, group, async_op, defer, flown)
        if flown is not None and work is None and not (defer and self._deferred.holds(flown)):
            self.flight.done(flown)  # type: ignore[union-attr]
        return work

    def finish(self) -> None:
        """Ends the reduce-scatter still under way, if one is (at the end of backward, and at the strategy's close)."""
        self._deferred.finish()

    def _reduce_scatter(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool,
        defer: bool = False,
        flown: int | None = None,
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
            if defer:
                self._deferred.start(output_tensor, input_tensor, group, flown, self.flight)
            else:
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


class _Deferred:
    """A unit's reduce-scatter through Gloo left under way while backward computes the next unit's gradients.

    FSDP2 on a CPU runs each unit's reduce-scatter where its backward ends, on the training thread (its streams are
    a GPU's), so through Gloo every all-to-all stood between two units' backward; MultiWorkerMirrored's all-reduce
    runs on Gloo's own threads meanwhile. Here unit k's all-to-all starts asynchronously and is waited for, and its
    rows summed into FSDP2's output, when unit k+1's starts (one in flight: two buffers of one unit more at the peak,
    in the memory plan) or when the backward ends (a final callback of the autograd engine, queued at the backward's
    first reduce-scatter), so every gradient is whole once `backward()` returns.

    FSDP2 reads the output at once where a parameter already has a gradient (it adds into it) or a hook reads one
    after accumulation, so a backward defers only when `may_defer` says no parameter is in either case at its first
    reduce-scatter (`weighting.no_gradient_read_in_backward`); a second backward into the same gradients (accumulation,
    two losses) runs as before. Each backward is told apart by the autograd engine's graph task, so one that raised
    half-way cannot leave its choice to the next.
    """

    def __init__(self) -> None:
        self._task: int | None = None
        self._deferring = False
        self._pending: tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, int | None, Any] | None = None

    def decide(self, may_defer: Callable[[], bool]) -> bool:
        """Whether this backward's reduce-scatters through Gloo may end later in it (decided at its first one)."""
        task = torch._C._current_graph_task_id()
        if task == -1:
            return False  # not inside an autograd backward: nothing would end it
        if task != self._task:
            self.finish()  # a backward that raised may have left one under way
            self._task, self._deferring = task, may_defer()
            if self._deferring:
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        return self._deferring

    def holds(self, flown: int | None) -> bool:
        return self._pending is not None and self._pending[4] == flown

    def start(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        flown: int | None,
        flight: FlightRecord | None,
    ) -> None:
        self.finish()  # the unit before: one in flight
        rows = torch.empty_like(input_tensor)
        work = dist.all_to_all_single(rows, input_tensor, group=group, async_op=True)
        # The input is kept until the rows have come: Gloo reads it on its own thread.
        self._pending = (work, rows, output_tensor, input_tensor, flown, flight)

    def finish(self) -> None:
        """Waits for the reduce-scatter under way, if any, and sums its rows into FSDP2's output."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        work, rows, output_tensor, input_tensor, flown, flight = pending
        work.wait()  # bounded by the process group's timeout, as every collective of the group
        world = input_tensor.numel() // output_tensor.numel()
        torch.sum(rows.view(world, -1), dim=0, out=output_tensor.view(-1))
        if flight is not None and flown is not None:
            flight.done(flown)


def _on_host(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.is_contiguous()
