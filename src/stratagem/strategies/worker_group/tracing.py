"""What the trace of every one-process-per-worker strategy shares (`stratagem.trace`, docs/trace.md): its recorder,
the whole run traced under `stratagem launch --trace`, the clocks aligned where every worker enters a trace, and the
spans every step has (the step, forward, the start of backward, the optimizer step).

A strategy's own trace subclasses `WorkerGroupTrace` and adds what only it knows: the collectives of its technique
(ShardedStrategy's units, `sharded/tracing.py`; DTensor's redistributions, `tensor_parallel/tracing.py`) and where
its backward ends. A subclass sets its own attributes before calling ``super().__init__``, which starts the
whole-run trace at once when `stratagem launch --trace` asked for one.
"""

from __future__ import annotations

import atexit
import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stratagem import environ, nest
from stratagem.errors import InputError
from stratagem.trace import Recorder
from stratagem.trace.clocks import align
from stratagem.trace.recorder import Clock, check_mode

if TYPE_CHECKING:
    from stratagem.cluster.worker_group import WorkerGroup


class WorkerGroupTrace:
    """A worker's recorder and the hooks every strategy's step shares (see the module docstring)."""

    round_name = "worker-group"
    """Names the clock alignment's rounds in the job's store (one name per strategy, a count after it)."""

    def __init__(self, group: WorkerGroup, *, step: Callable[[], int], env: Mapping[str, str]) -> None:
        self.recorder = Recorder(rank=group.rank, task=group.task_name, world_size=group.world_size)
        group.cross_worker.trace.recorder = self.recorder  # the group's own collectives (the batch check, BatchNorm)
        self._group = group
        self._step = step
        self._forward_start: int | None = None
        self._backward_start: int | None = None
        self._traces = 0
        self.directory = environ.trace_dir(env)  # `stratagem launch --trace DIR`: the whole run, written at exit
        if self.directory is not None:
            self._start(None, "spans")
            atexit.register(_write_at_exit, weakref.ref(self))

    # ---- what the strategy calls ------------------------------------------------------------------------
    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """`optimizer`, each of its steps a span while a trace records (torch's step hooks, which read one flag while
        none does); returns it."""
        recorder = self.recorder
        started: list[int | None] = [None]

        def before(opt: Any, args: Any, kwargs: Any) -> None:
            started[0] = recorder.now() if recorder.on else None

        def after(opt: Any, args: Any, kwargs: Any) -> None:
            if started[0] is not None and recorder.on:
                recorder.span("optimizer", "optimizer step", started[0], recorder.now())

        optimizer.register_step_pre_hook(before)
        optimizer.register_step_post_hook(after)
        return optimizer

    def step_started(self) -> int | None:
        """The trace's time at the start of `run` (None when nothing records); the spans from now are the step's."""
        recorder = self.recorder
        if not recorder.on:
            return None
        recorder.at_step(self._step() + 1)
        self._backward_start = None
        return recorder.now()

    def step_ended(self, started: int | None) -> None:
        """`run` has returned: the step's span, then, at every step's end while a trace is under way (recorded or
        not), `Recorder.after_step` with the step just ended, as `ReplicaSet` calls it: a sampled trace (`fit`'s
        default) decides there whether the next step records."""
        recorder = self.recorder
        if started is not None and recorder.on:
            recorder.span("step", f"step {recorder.step}", started, recorder.now())
        if recorder.recording:
            recorder.after_step(self._step())

    @contextlib.contextmanager
    def trace(self, directory: str | Path, *, clock: Clock | None = None, mode: str = "spans") -> Iterator[Recorder]:
        """The strategy's `trace(DIR)`: every worker enters at the same point (the clocks are aligned there)."""
        check_mode(mode)
        if self.recorder.recording:  # not `on`: a sampled trace is off between the steps it records
            raise InputError(
                f"A trace is recording already (to {self.directory!r}). Received: strategy.trace({str(directory)!r}) "
                "inside it. End the first trace, or unset STRATAGEM_TRACE (stratagem launch --trace) to trace only "
                "this range."
            )
        self._start(clock, mode)
        try:
            yield self.recorder
        finally:
            self.recorder.stop()
            self.recorder.write(directory)
            self.recorder.clear()

    def write_whole_run(self) -> None:
        """Under `stratagem launch --trace`: stops and writes the whole run's file (at exit; a file, no collective)."""
        if self.directory is not None and self.recorder.recording:
            self.recorder.stop()
            self.recorder.write(self.directory)

    # ---- inside --------------------------------------------------------------------------------------------
    def _start(self, clock: Clock | None, mode: str) -> None:
        recorder = self.recorder
        recorder.clear()
        if clock is not None:
            recorder.clock = clock
        self._traces += 1
        group = self._group
        recorder.clock_offset = align(
            group.cross_worker.store,
            rank=group.rank,
            world_size=group.world_size,
            clock=recorder.clock,
            round_id=f"{self.round_name}-{self._traces}",
            timeout=group.timeout,
        ).to_dict()
        recorder.start(mode=mode)
        self._started()

    def _started(self) -> None:
        """Called once a trace records: a subclass installs what it installs only then."""

    def _hook_forward(self, model: nn.Module) -> None:
        """The model's forward a span, from its first forward pre-hook to its forward hook, and the start of its
        backward at the gradient of its first output that needs one."""
        recorder = self.recorder

        def before(module: nn.Module, args: Any) -> None:
            self._forward_start = recorder.now() if recorder.on else None

        def after(module: nn.Module, args: Any, out: Any) -> None:
            start, self._forward_start = self._forward_start, None
            if start is None or not recorder.on:
                return
            recorder.span("forward", "forward", start, recorder.now())
            first = next((t for t in nest.flatten(out) if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if first is not None and torch.is_grad_enabled():
                first.register_hook(self._backward_started)

        # Before any pre-hook the technique installed (FSDP2's all-gather of the root), after its forward hooks.
        model.register_forward_pre_hook(before, prepend=True)
        model.register_forward_hook(after)

    def _backward_started(self, grad: torch.Tensor) -> None:
        if self._backward_start is None and self.recorder.on:
            self._backward_start = self.recorder.now()


def _write_at_exit(ref: weakref.ref[WorkerGroupTrace]) -> None:
    trace = ref()
    if trace is not None:
        trace.write_whole_run()
