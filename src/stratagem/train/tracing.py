"""`fit`'s trace: left on by default in summary mode, sampled and kept in memory; or every step into a directory.

`trace=True` (the default): a strategy that samples its steps (`Traceable.samples_steps`: MirroredStrategy,
MultiWorkerMirroredStrategy, ShardedStrategy, TensorParallelStrategy, ModelParallelStrategy) records this worker's
steps in summary mode (the step table, no spans), a sample of them at a rate that keeps the cost near 1% of the step
(`stratagem.trace.sample`), and `fit` returns the table on `history.trace` (`FitTrace`: its text, its JSON, and
`write(DIR)` for `stratagem trace summary DIR`). Nothing is written unless asked. The other strategies
(ParameterServerStrategy, whose functions are not steps to fold, OneDeviceStrategy, CentralStorageStrategy), and a
run already traced by `stratagem launch --trace` (STRATAGEM_TRACE), are left as they are.

`trace=DIR`: every worker records every step with its spans and writes its own `worker-<rank>.json` in DIR; a
barrier then lets the chief read every file and merge them into DIR/trace.json.gz (docs/trace.md). The strategy
must be a `stratagem.trace.Traceable` (the others are refused before any work).

`trace=False` (or None): no trace.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stratagem import environ
from stratagem.errors import InputError
from stratagem.strategies.base import Strategy
from stratagem.trace import Traceable
from stratagem.trace.fold import SUMMARY
from stratagem.trace.merge import JobTrace, merge, worker_trace
from stratagem.trace.recorder import Recorder, worker_file
from stratagem.trace.summary import TraceSummary, summarize

TraceSetting = str | Path | bool | None
"""`fit`'s `trace=`: True (summary mode, sampled, in memory), a directory (every step, to files), False or None."""


@dataclass
class FitTrace:
    """This worker's steps as `fit`'s trace left on recorded them (summary mode, a sample of the steps).

    Example:
        >>> history = sg.fit(strategy, net, optimizer, F.cross_entropy, loader, epochs=3)
        >>> print(history.trace.text())          # where a step's time went, on this worker
        >>> history.trace.write("traces/")       # then: stratagem trace summary traces/
    """

    summary: TraceSummary
    """The step table of the recorded steps (`summary.rows`, one per recorded step) and their means."""
    num_steps: int
    """Steps run while the trace was on."""
    num_recorded: int
    """Of those, the steps recorded (every step of a slow run, 1 in `every` of a fast one)."""
    every: int
    """The sampling interval at the end of the run (1: every step)."""
    world_size: int
    worker: dict[str, Any] = field(repr=False)
    """The contents of this worker's trace file (`write`)."""

    def text(self) -> str:
        """Where a step's time went on this worker, the mean of the recorded steps, and which steps those were."""
        steps = [r.step for r in self.summary.rows]
        shown = ", ".join(map(str, steps[:4])) + (", ..." if len(steps) > 4 else "")
        lines = [
            f"trace (summary mode, on by default): {self.num_recorded} of {self.num_steps} steps recorded "
            f"(1 in {self.every} at the end, to keep the cost near 1% of a step; steps {shown})"
        ]
        for task, mean in self.means().items():
            lines.append(
                f"  {task} {mean['step_ms']:.2f} ms a step: input {mean['input_ms']:.2f}, compute "
                f"{mean['compute_ms']:.2f}, communication {mean['communication_ms']:.2f}, idle {mean['idle_ms']:.2f}"
            )
        if self.world_size > 1:
            lines.append(
                "  (this worker alone: the split of communication into waiting for peers and transfer, and the late "
                "worker, need every worker's file: fit(trace=DIR) or stratagem train --trace DIR)"
            )
        return "\n".join(lines)

    def means(self) -> dict[str, dict[str, float]]:
        """Per worker, ms a step of the run, estimated from the recorded steps: each weighted by the steps it
        stands for (from it to the next recorded one), so that the slow first steps, recorded every one while the
        sampling interval is found, weigh as much as they lasted and no more."""
        out: dict[str, dict[str, float]] = {}
        keys = ("step_ms", "input_ms", "compute_ms", "peers_ms", "transfer_ms", "idle_ms")
        for task in dict.fromkeys(r.task for r in self.summary.rows):
            rows = sorted((r for r in self.summary.rows if r.task == task), key=lambda r: r.step)
            last = max(self.num_steps + rows[0].step, rows[-1].step + 1)  # steps are numbered from 1 or on from a run
            weights = [b.step - a.step for a, b in zip(rows, rows[1:])] + [max(1, last - rows[-1].step)]
            total = sum(weights)
            mean = {key: round(sum(w * getattr(r, key) for w, r in zip(weights, rows)) / total, 3) for key in keys}
            mean["communication_ms"] = round(mean["peers_ms"] + mean["transfer_ms"], 3)
            out[task] = mean
        return out

    def to_dict(self) -> dict[str, Any]:
        means = self.means()
        return {
            "mode": SUMMARY,
            "num_steps": self.num_steps,
            "num_recorded": self.num_recorded,
            "every": self.every,
            "recorded_steps": [r.step for r in self.summary.rows],
            "means": means,
        }

    def write(self, directory: str | Path) -> Path:
        """Writes this worker's trace file into `directory` (`stratagem trace summary DIR` reads it); its path."""
        path = worker_file(directory, int(self.worker["rank"]))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.worker, separators=(",", ":")))
        return path


def check_trace(strategy: Strategy, trace: TraceSetting) -> None:
    """Refuses a `trace=` that is neither a directory name nor True/False/None, and a directory for a strategy that
    cannot record its steps (`trace=True` traces those that can sample theirs and leaves the others alone)."""
    if trace is None or isinstance(trace, bool):
        return
    if not isinstance(trace, (str, Path)) or not str(trace):
        raise InputError(
            f"trace must name a directory, or be True or False. Received: trace={trace!r}. Pass a path such as "
            "trace='traces/', trace=True (the default: the step table of a sample of the steps, in memory) or "
            "trace=False."
        )
    if not isinstance(strategy, Traceable):
        raise InputError(
            f"{type(strategy).__name__} does not record traces yet. Received: trace={str(trace)!r}. Use "
            "MultiWorkerMirroredStrategy (docs/trace.md lists the strategies traced), or leave trace out."
        )


def samples_steps(strategy: Strategy) -> bool:
    """Whether `trace=True` traces `strategy`: a traced strategy that ends every step with `Recorder.after_step`
    (`Traceable.samples_steps`: MirroredStrategy, MultiWorkerMirroredStrategy, ShardedStrategy,
    TensorParallelStrategy, ModelParallelStrategy), in a process no launcher traces."""
    return isinstance(strategy, Traceable) and strategy.samples_steps and environ.trace_dir() is None


@dataclass
class TraceOutcome:
    """What `traced_run` leaves once its block has ended: `FitTrace` for `trace=True`, else None."""

    left_on: FitTrace | None = None


@contextlib.contextmanager
def traced_run(
    strategy: Strategy, trace: TraceSetting, *, is_chief: bool, outcome: TraceOutcome | None = None
) -> Iterator[Recorder | None]:
    """Traces the steps run inside the block as `trace` says (module docstring); yields the recorder (None: no
    trace). `outcome.left_on` receives the table of `trace=True` when the block ends cleanly."""
    if trace is None or trace is False:
        yield None
        return
    if trace is True:
        if not samples_steps(strategy):
            yield None
            return
        assert isinstance(strategy, Traceable), "samples_steps checked it"
        with tempfile.TemporaryDirectory(prefix="stratagem-fit-trace-") as directory:
            with strategy.trace(directory, mode=SUMMARY) as recorder:
                sample = recorder.sample_steps()
                yield recorder
            worker = json.loads(worker_file(directory, recorder.rank).read_text())
            if outcome is not None:
                outcome.left_on = FitTrace(
                    summarize(JobTrace([worker_trace(worker)])), sample.num_steps, sample.num_recorded, sample.every,
                    recorder.world_size, worker,
                )  # fmt: skip
        return
    assert isinstance(strategy, Traceable), "check_trace refuses the others before any work"
    merged = Path(trace) / "trace.json.gz"
    with strategy.trace(trace) as recorder:
        yield recorder
    if not strategy.writes_every_file:
        strategy.barrier()  # every worker's file is written before the chief reads them
    if is_chief:
        merge(trace, merged)
