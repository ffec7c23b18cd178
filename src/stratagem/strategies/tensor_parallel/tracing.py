"""The trace of a TensorParallelStrategy (`stratagem.trace`, docs/trace.md): each step, its input, forward, backward
and optimizer step, and every collective of the step: those DTensor issues (the all-reduce of a partial sum, the
all-gather of a split output, the reduce-scatter of a gradient) and the data axis's weighted sums.

The collectives are seen as torch's own `CommDebugMode` sees them: a dispatch mode, on while a step runs and a trace
records, steps aside for every op on DTensors (so that DTensor turns it into plain ops and collectives first) and
records each functional collective it then sees (`_c10d_functional`: entered when issued, done when its
`wait_tensor` returns, that wait a span of its own) and each `torch.distributed` collective (`c10d`: the data axis's
`all_reduce`, the user's own; done when its work completes, waited for from its call on, since `torch.distributed`
waits at once unless asked not to). Each is named by its op and mesh axis (`all-reduce (model axis)`), with the
bytes this rank sends: its part for an all-gather, its whole input for an all-reduce or a reduce-scatter. Forward
runs from the model's first forward pre-hook to its forward hook (the outputs made whole, an all-gather, inside
it); backward from the gradient of the model's output to the end of the backward pass, the data axis's sum included
(an autograd callback queued after it). What every strategy's trace shares (the recorder, the clocks, `trace(DIR)`,
the whole run under `stratagem launch --trace`) is `worker_group/tracing.py`'s.

    >>> trace = TensorParallelTrace(group, torch_mesh, step=lambda: strategy_steps, env=environ.current())
    >>> with trace.trace("traces/"):
    ...     strategy.run(train_step, args=(x, y))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from stratagem import nest
from stratagem.strategies.worker_group.tracing import WorkerGroupTrace

if TYPE_CHECKING:
    from stratagem.cluster.worker_group import WorkerGroup

_FUNCTIONAL = {  # torch.ops._c10d_functional.<name> -> op as the trace names it
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}
_C10D = {  # torch.ops.c10d.<name> -> op (the group is the op's argument after the tensors)
    "allreduce_": "all_reduce",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "broadcast_": "broadcast",
    "alltoall_base_": "all_to_all",
}


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in nest.flatten(value) if isinstance(t, torch.Tensor)]


class _CollectiveMode(TorchDispatchMode):
    """Records the collectives of a step (see the module docstring) into `trace`'s recorder."""

    def __init__(self, trace: TensorParallelTrace) -> None:
        super().__init__()
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
        from torch.distributed.tensor import DTensor

        self._trace = trace
        self._subclasses = (DTensor, AsyncCollectiveTensor)
        self._pending: dict[int, tuple[int, str]] = {}  # id of a functional collective's output -> (seq, what)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, self._subclasses) for t in types):
            return NotImplemented  # DTensor (or an async result) first turns it into plain ops, seen again here
        kwargs = kwargs or {}
        packet = getattr(func, "_overloadpacket", None)
        namespace, _, name = getattr(packet, "_qualified_op_name", "").partition("::")
        recorder = self._trace.recorder
        if not recorder.on or namespace not in ("_c10d_functional", "c10d"):
            return func(*args, **kwargs)
        if namespace == "_c10d_functional" and name == "wait_tensor":
            return self._wait(func, args, kwargs)
        op = (_FUNCTIONAL if namespace == "_c10d_functional" else _C10D).get(name)
        if op is None:
            return func(*args, **kwargs)
        tensors = _tensors(args[0])
        # A functional collective's last string argument is its group's name (before it: the reduce op's).
        group = [a for a in args[1:] if isinstance(a, str)][-1:] if namespace == "_c10d_functional" else []
        what = f"{op.replace('_', '-')} ({self._trace.axis_of(group[0] if group else None, args)})"
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        seq = recorder.collective(op, what, recorder.step, nbytes, self._trace.transport)
        out = func(*args, **kwargs)
        if namespace == "_c10d_functional":
            for t in _tensors(out):
                self._pending[id(t)] = (seq, what)
        else:
            self._waited_from_call(seq, what, out)
        return out

    def _wait(self, func: Any, args: Any, kwargs: Any) -> Any:
        recorder = self._trace.recorder
        entry = self._pending.pop(id(args[0]), None)
        start = recorder.now()
        out = func(*args, **kwargs)
        if entry is not None:
            end = recorder.now()
            recorder.done(entry[0], end)
            recorder.span("wait", entry[1], start, end, args={"seqs": [entry[0]]})
        return out

    def _waited_from_call(self, seq: int, what: str, out: Any) -> None:
        """A `torch.distributed` collective: the caller waits for its work from now on; it ends when the work does."""
        import torch.distributed as dist

        recorder = self._trace.recorder
        start, track = recorder.now(), recorder.track()
        work = next((x for x in nest.flatten(out) if isinstance(x, torch.ScriptObject)), None)
        if work is None:
            recorder.done(seq, start)
            return

        def ended(_: Any) -> None:
            end = recorder.now()
            recorder.done(seq, end)
            if recorder.on:
                recorder.span("wait", what, start, end, track=track, args={"seqs": [seq]})

        dist.Work.unbox(work).get_future().add_done_callback(ended)


class TensorParallelTrace(WorkerGroupTrace):
    """One TensorParallelStrategy's recorder and the hooks that feed it (see the module docstring)."""

    round_name = "tensor-parallel"

    def __init__(self, group: WorkerGroup, torch_mesh: Any, *, step: Callable[[], int], env: Mapping[str, str]) -> None:
        self._axes = {torch_mesh[name].get_group().group_name: name for name in torch_mesh.mesh_dim_names}
        self.transport = group.backend
        self._mode: _CollectiveMode | None = None
        super().__init__(group, step=step, env=env)

    def axis_of(self, group_name: str | None, args: Any) -> str:
        """The mesh axis of a collective's process group: by its name (a functional collective's argument), else
        the group a `c10d` op takes after its tensors."""
        import torch.distributed as dist

        if group_name is None and len(args) > 1 and isinstance(args[1], torch.ScriptObject):
            group_name = dist.ProcessGroup.unbox(args[1]).group_name
        axis = self._axes.get(group_name) if group_name is not None else None
        return f"{axis} axis" if axis is not None else "all workers"

    # ---- what the strategy calls ------------------------------------------------------------------------
    def add(self, model: nn.Module) -> None:
        """The model `distribute` hands back: its forward a span, and the start of its backward."""
        self._hook_forward(model)

    def recording(self) -> contextlib.AbstractContextManager[Any]:
        """Around the step function: the collectives' dispatch mode while a trace records (nothing otherwise)."""
        if not self.recorder.on:
            return contextlib.nullcontext()
        if self._mode is None:
            self._mode = _CollectiveMode(self)
        return self._mode

    # ---- inside --------------------------------------------------------------------------------------------
    def _backward_started(self, grad: torch.Tensor) -> None:
        if self._backward_start is None and self.recorder.on:
            self._backward_start = self.recorder.now()
            # Queued now, this callback runs first at the end of backward; the one it queues runs last, after the
            # data axis's sum (queued at the first gradient accumulated).
            engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
            engine.queue_callback(lambda: engine.queue_callback(self._backward_ended))

    def _backward_ended(self) -> None:
        start, self._backward_start = self._backward_start, None
        if start is not None and self.recorder.on:
            self.recorder.span("backward", "backward", start, self.recorder.now())
