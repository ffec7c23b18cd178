"""Where each step's time went, per worker, and who made the others wait: a trace's report as data.

A step's window on a worker runs from the end of its previous step (`strategy.run`) to the end of this one,
so the windows tile the worker's time and every step's input is in it. Within it the timeline
(`timeline.py`) gives input, compute (forward, backward, optimizer and the rest of the step function),
waiting for peers, transfer and idle, which add up to the window by construction; exposed communication is
waiting plus transfer (communication no compute overlaps, since compute wins the painting only where the
thread computes). The late worker is named by arrival (`late.py`). A trace in summary mode (`fold.py`) gives the
same table from its folded steps: only its waits are painted here, split at the last worker's arrival. A
parameter-server job's trace has no steps in common and no collectives: `report` gives `functions.py`'s report for it.

    >>> report = summarize(load("traces/"))
    >>> print(report.text()); report.to_dict(); report.plot("traces/breakdown.png")
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stratagem.errors import InputError
from stratagem.trace.fold import SUMMARY
from stratagem.trace.functions import FunctionsSummary, is_functions_trace, summarize_functions
from stratagem.trace.late import LateStep, LateWorker, Stretch, late_steps, name_late_workers
from stratagem.trace.merge import FoldedStep, JobTrace, WorkerTrace
from stratagem.trace.pipeline import PipelineBubble, measure_bubble
from stratagem.trace.timeline import PHASES, Timeline, last_arrivals, paint, paint_spans

COLUMNS = ("input", "compute", "peers", "transfer", "idle")
"""The parts of a step's time that add up to it."""


@dataclass(frozen=True)
class StepRow:
    """One step of one worker, in milliseconds."""

    step: int
    task: str
    rank: int
    step_ms: float
    input_ms: float
    compute_ms: float
    peers_ms: float
    """Waiting for peers: inside a collective before the last worker arrived."""
    transfer_ms: float
    """Inside a collective after the last worker arrived, with no compute overlapping."""
    idle_ms: float
    forward_ms: float
    backward_ms: float
    optimizer_ms: float

    @property
    def exposed_ms(self) -> float:
        """Exposed communication: waiting for peers plus transfer."""
        return self.peers_ms + self.transfer_ms

    @property
    def parts_ms(self) -> float:
        return self.input_ms + self.compute_ms + self.peers_ms + self.transfer_ms + self.idle_ms


@dataclass
class TraceSummary:
    """A trace's report: the rows, each step's last worker to arrive, the late workers named, the clocks."""

    rows: list[StepRow]
    late_steps: list[LateStep]
    named: list[LateWorker]
    clocks: dict[str, dict[str, float]] = field(default_factory=dict)
    """Each task's clock offset to the chief's and its error bound, in ms."""
    pipeline: PipelineBubble | None = None
    """The pipeline's bubble, measured, beside GPipe's (a trace of ModelParallelStrategy's stages)."""

    def text(self) -> str:
        head = f"{'step':>5} {'worker':<10} {'step ms':>8} {'input':>7} {'compute':>8} {'peers':>7} {'transfer':>9} {'idle':>7}  (fwd/bwd/opt)"
        lines = [head]
        for r in self.rows:
            lines.append(
                f"{r.step:>5} {r.task:<10} {r.step_ms:>8.2f} {r.input_ms:>7.2f} {r.compute_ms:>8.2f} {r.peers_ms:>7.2f} "
                f"{r.transfer_ms:>9.2f} {r.idle_ms:>7.2f}  ({r.forward_ms:.2f}/{r.backward_ms:.2f}/{r.optimizer_ms:.2f})"
            )
        lines.append("")
        lines.append("mean per step:")
        for task, mean in self.means().items():
            lines.append(
                f"  {task:<10} {mean['step_ms']:>8.2f} ms: input {mean['input_ms']:.2f}, compute {mean['compute_ms']:.2f}, "
                f"waiting for peers {mean['peers_ms']:.2f}, transfer {mean['transfer_ms']:.2f}, idle {mean['idle_ms']:.2f}"
            )
        lines.append("clocks (offset to the chief, error bound): " + ", ".join(
            f"{task} {c['offset_ms']:+.3f} ms ± {c['error_ms']:.3f}" for task, c in self.clocks.items()
        ))  # fmt: skip
        if self.pipeline is not None:
            lines.append(self.pipeline.describe())
        if self.named:
            lines += [w.describe() for w in self.named]
        else:
            lines.append("late worker: none (no worker arrived last at most steps of a window by a clear margin)")
        return "\n".join(lines)

    def means(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for task in dict.fromkeys(r.task for r in self.rows):
            mine = [r for r in self.rows if r.task == task]
            out[task] = {
                key: round(statistics.fmean(getattr(r, key) for r in mine), 3)
                for key in ("step_ms", "input_ms", "compute_ms", "peers_ms", "transfer_ms", "idle_ms")
            }
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": [{**asdict(r), "exposed_ms": round(r.exposed_ms, 3)} for r in self.rows],
            "means": self.means(),
            "late_steps": [asdict(s) for s in self.late_steps],
            "named": [w.to_dict() for w in self.named],
            "clocks": self.clocks,
            "pipeline": None if self.pipeline is None else self.pipeline.to_dict(),
        }

    def plot(self, path: str | Path) -> Path:
        """A PNG of each worker's breakdown over the steps (stacked bars, one panel per worker)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        tasks = list(dict.fromkeys(r.task for r in self.rows))
        fig, axes = plt.subplots(len(tasks), 1, figsize=(10, 2.6 * len(tasks)), sharex=True, squeeze=False)
        colors = {
            "input": "#4c9be8",
            "compute": "#59a14f",
            "peers": "#e15759",
            "transfer": "#f28e2b",
            "idle": "#bab0ac",
        }
        for ax, task in zip(axes[:, 0], tasks):
            mine = [r for r in self.rows if r.task == task]
            steps = [r.step for r in mine]
            bottom = [0.0] * len(mine)
            for column in COLUMNS:
                values = [getattr(r, f"{column}_ms") for r in mine]
                label = {"peers": "waiting for peers"}.get(column, column)
                ax.bar(steps, values, bottom=bottom, color=colors[column], label=label, width=0.85)
                bottom = [b + v for b, v in zip(bottom, values)]
            ax.set_ylabel(f"{task}\nms per step")
        axes[0, 0].legend(loc="upper right", ncol=5, fontsize=8)
        axes[-1, 0].set_xlabel("step")
        fig.suptitle("Where each step's time went, per worker")
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def _windows(worker: WorkerTrace) -> dict[int, tuple[int, int]]:
    """Each step's window on this worker: from the end of the step before (or the first span) to its end."""
    steps = sorted((s for s in worker.spans if s.category == "step" and s.track == "main"), key=lambda s: s.end)
    out: dict[int, tuple[int, int]] = {}
    previous: int | None = None
    for s in steps:
        if previous is None:
            previous = min((x.start for x in worker.spans if x.end <= s.end), default=s.start)
        out[s.step] = (previous, s.end)
        previous = s.end
    return out


def _ms(ns: int) -> float:
    return round(ns / 1e6, 3)


def report(job: JobTrace) -> TraceSummary | FunctionsSummary:
    """The report of any trace: `summarize`'s, or a parameter-server job's (`functions.summarize_functions`)."""
    return summarize_functions(job) if is_functions_trace(job) else summarize(job)


def summarize(job: JobTrace) -> TraceSummary:
    """The report of `job` (see the module docstring)."""
    if is_functions_trace(job):
        raise InputError(
            "A parameter-server job's trace has no step that every worker shares, so no step table. Received: the "
            f"files of {', '.join(w.task for w in job.workers)}. Read it with stratagem.trace.summary.report(job) "
            "(or `stratagem trace summary DIR`), which gives each worker's functions and each server's updates."
        )
    last = last_arrivals(job)
    modes = {w.mode for w in job.workers}
    if len(modes) > 1:
        raise InputError(
            f"The workers' files were traced in different modes. Received: {', '.join(sorted(modes))}. Trace every "
            "worker in one mode (strategy.trace(DIR, mode=...) on every worker)."
        )
    if modes == {SUMMARY}:
        return _summarize_folded(job, last)
    timelines: dict[int, Timeline] = {w.rank: paint(w, last) for w in job.workers}
    windows = {w.rank: _windows(w) for w in job.workers}

    def stretch(rank: int, seq: int, since: int, arrived: int) -> dict[str, int]:
        return timelines[rank].totals(since, arrived)

    return _report(job, windows, lambda w, step, start, end: timelines[w.rank].totals(start, end), stretch)


def _summarize_folded(job: JobTrace, last: dict[int, int]) -> TraceSummary:
    """The report of a trace in summary mode, from each worker's folded steps and stretches."""
    folded = {w.rank: {s.step: s for s in w.steps} for w in job.workers}
    windows = {rank: {step: (s.start, s.end) for step, s in steps.items()} for rank, steps in folded.items()}
    stretches = {w.rank: w.stretches for w in job.workers}
    zeros = dict.fromkeys(PHASES, 0)

    def totals(w: WorkerTrace, step: int, start: int, end: int) -> dict[str, int]:
        mine: FoldedStep = folded[w.rank][step]
        waits = paint_spans((("wait", a, b, {"seqs": seqs}) for a, b, seqs in mine.waits), last).totals(start, end)
        return {**mine.totals, "peers": waits["peers"], "transfer": waits["transfer"]}

    def stretch(rank: int, seq: int, since: int, arrived: int) -> dict[str, int]:
        return stretches[rank].get(seq, zeros)

    return _report(job, windows, totals, stretch)


def _report(
    job: JobTrace,
    windows: dict[int, dict[int, tuple[int, int]]],
    totals: Callable[[WorkerTrace, int, int, int], dict[str, int]],
    stretch: Stretch,
) -> TraceSummary:
    """The rows of the steps every worker has, the late worker of each, the clocks."""
    common = sorted(set.intersection(*(set(ws) for ws in windows.values()))) if windows else []
    rows = []
    for step in common:
        for w in job.workers:
            start, end = windows[w.rank][step]
            t = totals(w, step, start, end)
            compute = t["forward"] + t["backward"] + t["optimizer"] + t["compute"]
            rows.append(
                StepRow(step, w.task, w.rank, _ms(end - start), _ms(t["input"]), _ms(compute), _ms(t["peers"]),
                        _ms(t["transfer"]), _ms(t["idle"]), _ms(t["forward"]), _ms(t["backward"]), _ms(t["optimizer"]))
            )  # fmt: skip
    steps_late = late_steps(job, stretch, windows, common)
    step_ms = {step: statistics.median(r.step_ms for r in rows if r.step == step) for step in common}
    clocks = {w.task: {"offset_ms": w.offset_ns / 1e6, "error_ms": w.error_ns / 1e6} for w in job.workers}
    pipeline = measure_bubble(job.workers[0]) if len(job.workers) == 1 else None
    return TraceSummary(rows, steps_late, name_late_workers(steps_late, step_ms), clocks, pipeline)
