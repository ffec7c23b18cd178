"""The trace of a ShardedStrategy (`stratagem.trace`, docs/trace.md): each step, its input, forward, backward and
optimizer step, and each unit's all-gather of parameters and reduce-scatter of gradients, named by the unit.

The collectives are recorded by wrapping the comms the strategy installs in FSDP2 (`traced_comms.py`; a unit
without a custom all-gather gets FSDP2's own, wrapped). The wrappers are installed on a model's units when a
trace first starts with that model distributed, and stay: while no trace records they cost one attribute read
per collective. Forward runs from the root module's first forward pre-hook to its last forward hook (so the
root's own all-gather is inside it); backward from the gradient of the model's first output that needs one to
the end of the step's last reduce-scatter. The strategy calls `step_started` and `step_ended` around each
`run`, `add` and `watch_optimizer` at each `distribute`, and hands `recorder` to its input; under `stratagem launch --trace` the whole run is written at exit.

    >>> trace = ShardedTrace(group, step=lambda: strategy_steps, env=environ.current())
    >>> with trace.trace("traces/"):
    ...     strategy.run(train_step, args=(x, y))
"""

from __future__ import annotations

import atexit
import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
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
    from stratagem.strategies.sharded.traced_comms import UnitComms


class ShardedTrace:
    """One ShardedStrategy's recorder and the hooks that feed it (see the module docstring)."""

    def __init__(self, group: WorkerGroup, *, step: Callable[[], int], env: Mapping[str, str]) -> None:
        self.recorder = Recorder(rank=group.rank, task=group.task_name, world_size=group.world_size)
        group.cross_worker.trace.recorder = self.recorder  # the group's own collectives (batch check, BatchNorm)
        self._group = group
        self._step = step
        self._models: list[tuple[nn.Module, list[tuple[str, nn.Module]], Any]] = []
        self._traced: set[int] = set()  # ids of the models whose units are wrapped
        self._units: list[UnitComms] = []
        self._forward_start: int | None = None
        self._backward_start: int | None = None
        self._traces = 0
        self.directory = environ.trace_dir(env)  # `stratagem launch --trace DIR`: the whole run, written at exit
        if self.directory is not None:
            self._start(None, "spans")
            atexit.register(_write_at_exit, weakref.ref(self))

    # ---- what the strategy calls ------------------------------------------------------------------------
    def add(self, model: nn.Module, units: Sequence[tuple[str, nn.Module]], comm: Any) -> None:
        """A model just distributed: its FSDP2 units, each with its name (`root`, `h.0-3` for merged blocks) and the
        module that stands for it, and `comm`, the strategy's reduce-scatter for them."""
        self._models.append((model, list(units), comm))
        if self.recorder.on:
            self._install()

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer `distribute` handed back: each of its steps a span while a trace records (torch's step
        hooks, which read one flag while none does)."""
        recorder = self.recorder
        started: list[int | None] = [None]

        def before(opt: Any, args: Any, kwargs: Any) -> None:
            started[0] = recorder.now() if recorder.on else None

        def after(opt: Any, args: Any, kwargs: Any) -> None:
            if started[0] is not None and recorder.on:
                recorder.span("optimizer", "optimizer step", started[0], recorder.now())

        optimizer.register_step_pre_hook(before)
        optimizer.register_step_post_hook(after)

    def step_started(self) -> int | None:
        """The trace's time at the start of `run` (None when nothing records); the spans from now are the step's."""
        recorder = self.recorder
        if not recorder.on:
            return None
        recorder.at_step(self._step() + 1)
        self._backward_start = None
        return recorder.now()

    def step_ended(self, started: int | None) -> None:
        """`run` has returned: its step span, and its backward's, which ended with its last reduce-scatter."""
        recorder = self.recorder
        if started is None or not recorder.on:
            return
        ends = [u.last_reduce_scatter_end for u in self._units if u.last_reduce_scatter_end is not None]
        start, end = self._backward_start, max(ends, default=None)
        if start is not None and end is not None and end > start:
            recorder.span("backward", "backward", start, end)
        for unit in self._units:
            unit.last_reduce_scatter_end = None
        recorder.span("step", f"step {recorder.step}", started, recorder.now())

    @contextlib.contextmanager
    def trace(self, directory: str | Path, *, clock: Clock | None = None, mode: str = "spans") -> Iterator[Recorder]:
        """`ShardedStrategy.trace`: every worker enters at the same point (the clocks are aligned there)."""
        check_mode(mode)
        if self.recorder.on:
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
        if self.directory is not None and self.recorder.on:
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
            round_id=f"sharded-{self._traces}",
            timeout=group.timeout,
        ).to_dict()
        recorder.start(mode=mode)
        self._install()

    def _install(self) -> None:
        """Wraps the comms of every model's units not wrapped yet, and hooks its forward and optimizer."""
        from stratagem.strategies.sharded.reduce_scatter import SharedMemoryAllGather
        from stratagem.strategies.sharded.traced_comms import (
            TracedAllGather,
            TracedReduceScatter,
            UnitComms,
            default_all_gather,
        )

        shared = self._group.cross_worker.shared
        for model, units, comm in self._models:
            if id(model) in self._traced:
                continue
            self._traced.add(id(model))
            for name, unit in units:
                comms = UnitComms(self._group.cross_worker.trace, name, self._step, shared is not None)
                self._units.append(comms)
                # As weighting.weigh_gradients installed them: the shared-memory all-gather where it connected one.
                gather = (
                    default_all_gather()
                    if shared is None
                    else SharedMemoryAllGather(shared, self._step, self._group.cross_worker.flight)
                )
                unit.set_custom_all_gather(TracedAllGather(gather, comms))  # type: ignore[operator]
                unit.set_custom_reduce_scatter(TracedReduceScatter(comm, comms))  # type: ignore[operator]
            self._hook_forward(model)

    def _hook_forward(self, model: nn.Module) -> None:
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

        # Before FSDP2's own pre-hook (its all-gather of the root), after its post-hook (the reshard).
        model.register_forward_pre_hook(before, prepend=True)
        model.register_forward_hook(after)

    def _backward_started(self, grad: torch.Tensor) -> None:
        if self._backward_start is None and self.recorder.on:
            self._backward_start = self.recorder.now()


def _write_at_exit(ref: weakref.ref[ShardedTrace]) -> None:
    trace = ref()
    if trace is not None:
        trace.write_whole_run()
