"""The trace of a ShardedStrategy (`stratagem.trace`, docs/trace.md): each step, its input, forward, backward and
optimizer step, and each unit's all-gather of parameters and reduce-scatter of gradients, named by the unit.

The collectives are recorded by wrapping the comms the strategy installs in FSDP2 (`traced_comms.py`; a unit
without a custom all-gather gets FSDP2's own, wrapped). The wrappers are installed on a model's units when a
trace first starts with that model distributed, and stay: while no trace records they cost one attribute read
per collective. Forward runs from the root module's first forward pre-hook to its last forward hook (so the
root's own all-gather is inside it); backward from the gradient of the model's first output that needs one to
the end of the step's last reduce-scatter. The strategy calls `step_started` and `step_ended` around each
`run`, `add` and `watch_optimizer` at each `distribute`, and hands `recorder` to its input; what every strategy's
trace shares (the recorder, the clocks, `trace(DIR)`, the whole run under `stratagem launch --trace`) is
`worker_group/tracing.py`'s.

    >>> trace = ShardedTrace(group, step=lambda: strategy_steps, env=environ.current())
    >>> with trace.trace("traces/"):
    ...     strategy.run(train_step, args=(x, y))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from stratagem.strategies.worker_group.tracing import WorkerGroupTrace

if TYPE_CHECKING:
    from stratagem.cluster.worker_group import WorkerGroup
    from stratagem.strategies.sharded.traced_comms import UnitComms


class ShardedTrace(WorkerGroupTrace):
    """One ShardedStrategy's recorder and the hooks that feed it (see the module docstring)."""

    round_name = "sharded"

    def __init__(self, group: WorkerGroup, *, step: Callable[[], int], env: Mapping[str, str]) -> None:
        self._models: list[tuple[nn.Module, list[tuple[str, nn.Module]], Any]] = []
        self._traced: set[int] = set()  # ids of the models whose units are wrapped
        self._units: list[UnitComms] = []
        super().__init__(group, step=step, env=env)

    # ---- what the strategy calls ------------------------------------------------------------------------
    def add(self, model: nn.Module, units: Sequence[tuple[str, nn.Module]], comm: Any) -> None:
        """A model just distributed: its FSDP2 units, each with its name (`root`, `h.0-3` for merged blocks) and the
        module that stands for it, and `comm`, the strategy's reduce-scatter for them."""
        self._models.append((model, list(units), comm))
        if self.recorder.recording:  # a sampled trace may be off between the steps it records
            self._install()

    def step_ended(self, started: int | None) -> None:
        """`run` has returned: its backward's span, which ended with its last reduce-scatter, then the base's (the
        step span, and `Recorder.after_step` at every step's end, recorded or not)."""
        recorder = self.recorder
        if started is not None and recorder.on:
            ends = [u.last_reduce_scatter_end for u in self._units if u.last_reduce_scatter_end is not None]
            start, end = self._backward_start, max(ends, default=None)
            if start is not None and end is not None and end > start:
                recorder.span("backward", "backward", start, end)
            for unit in self._units:
                unit.last_reduce_scatter_end = None
        super().step_ended(started)

    # ---- inside --------------------------------------------------------------------------------------------
    def _started(self) -> None:
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
