"""Each unit's all-gather and reduce-scatter as collectives of the trace (`stratagem.trace`), around the comms the
strategy installs in FSDP2 (`reduce_scatter.py`), named by the unit.

A module of its own because it subclasses torch's `AllGather` and `ReduceScatter`, so importing it imports
`torch.distributed.fsdp`: `tracing.py` imports it when a trace first starts on a sharded model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

if TYPE_CHECKING:
    from stratagem.collective.trace_hooks import CollectiveTrace


class UnitComms:
    """What both of a unit's traced comms share: the trace, the unit's name, the step, the path of its tensors."""

    def __init__(self, trace: CollectiveTrace, unit: str, step: Callable[[], int], shared: bool) -> None:
        self.trace = trace
        self.unit = unit
        self.step = step
        self.shared = shared
        """Every worker on this host: host tensors go through shared memory (`reduce_scatter.py`)."""
        self.last_reduce_scatter_end: int | None = None
        """When this unit's last reduce-scatter of gradients ended (the end of backward, for the trace)."""

    def call(self, op: str, tensor: torch.Tensor, run: Callable[[], dist.Work | None]) -> dist.Work | None:
        """`run()`, the collective, recorded as entered now and done when it returns (or when its work is); while no
        trace records (a step a sampled trace skips), `run()` alone, after one flag read."""
        recorder = self.trace.recorder
        if recorder is None or not recorder.on:
            return run()
        what = f"{op.replace('_', '-')} of {self.unit}"
        seq = self.trace.enter(op, what, self.step(), tensor, shared=self.shared and tensor.device.type == "cpu")
        work = run()
        if work is None:
            self.trace.summed_here(seq, what)  # done: this thread waited inside it
        else:
            self.trace.issued(seq, work, callback=True)  # FSDP2 waits for it, not CrossWorker
        return work


class TracedAllGather(AllGather):
    """`inner`, the unit's all-gather of parameters, recorded (bytes: this rank's shard)."""

    def __init__(self, inner: AllGather, comms: UnitComms) -> None:
        self.inner = inner
        self.comms = comms

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        return self.comms.call(
            "all_gather", input_tensor, lambda: self.inner(output_tensor, input_tensor, group, async_op)
        )


class TracedReduceScatter(ReduceScatter):
    """`inner`, the strategy's weighted reduce-scatter of gradients (shared by every unit), recorded for this unit
    (bytes: this rank's whole flat gradient)."""

    def __init__(self, inner: ReduceScatter, comms: UnitComms) -> None:
        self.inner = inner
        self.comms = comms

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> dist.Work | None:
        work = self.comms.call(
            "reduce_scatter", input_tensor, lambda: self.inner(output_tensor, input_tensor, group, op, async_op)
        )
        recorder = self.comms.trace.recorder
        if recorder is not None and recorder.on:
            self.comms.last_reduce_scatter_end = recorder.now()
        return work


def default_all_gather() -> AllGather:
    """FSDP2's own all-gather, for a unit that has no custom one (the strategy installs one only with shared
    memory)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    return DefaultAllGather()
