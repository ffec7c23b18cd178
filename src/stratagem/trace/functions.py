"""The report of a trace of scheduled functions (a parameter-server job): what each worker's functions spent their
time on, and each parameter server's updates.

Workers of a parameter server never wait for each other: each runs the functions the coordinator hands it, pulls
the values and pushes its gradients on its own. So there is no step that every worker shares, no collective, no
waiting for peers and no late worker; the step table and the late-worker rule (`summary.py`, `late.py`) do not
apply. What is measured instead, per worker, from its first function's start to its last one's end: the time in
functions and between them (idle: waiting for the coordinator's next one), and within the functions, painted so
that the parts add up (a wait wins over the phase it happens in): waiting on pulls, waiting on pushes, forward, the
optimizer step (less its push), and the rest (backward, the loss, the user's code). Per parameter server: the pushes
applied and the time they took.

    >>> report = summarize_functions(load("traces/"))
    >>> print(report.text()); report.to_dict()
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from stratagem.trace.merge import JobTrace, Span, WorkerTrace

FUNCTION = "function"
"""The category of a scheduled function's span on its worker (`parameter_server/tracing.py`)."""
PARTS = ("pull", "push", "forward", "optimizer", "other")
"""A function's time, by the priority its spans are painted with, highest first."""


def is_functions_trace(job: JobTrace) -> bool:
    """Whether `job` is a parameter-server job's trace (a server's file, or scheduled functions)."""
    return any(w.role != "worker" or any(s.category == FUNCTION for s in w.spans) for w in job.workers)


@dataclass(frozen=True)
class WorkerFunctions:
    """One worker's functions, in milliseconds: `functions_ms` is the sum of the five parts."""

    task: str
    rank: int
    functions: int
    span_ms: float
    """From its first function's start to its last one's end: `functions_ms` + `idle_ms`."""
    functions_ms: float
    idle_ms: float
    pull_ms: float
    push_ms: float
    forward_ms: float
    optimizer_ms: float
    other_ms: float
    pulled_bytes: int
    pushed_bytes: int

    @property
    def mean_ms(self) -> float:
        return self.functions_ms / self.functions if self.functions else 0.0


@dataclass(frozen=True)
class ServerUpdates:
    """One parameter server's updates."""

    task: str
    rank: int
    updates: int
    update_ms: float
    """The time spent applying pushes (receiving a gRPC push's bytes included)."""


@dataclass
class FunctionsSummary:
    """A parameter-server trace's report (see the module docstring), as text and JSON."""

    workers: list[WorkerFunctions]
    servers: list[ServerUpdates]
    dispatched: int
    """Functions the chief dispatched while the trace recorded."""
    clocks: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def rows(self) -> list[Any]:
        """No step table: the workers share no step (for callers that plot `TraceSummary.rows`)."""
        return []

    def text(self) -> str:
        functions = sum(w.functions for w in self.workers)
        lines = [
            f"parameter-server trace: {functions} functions on {_count(len(self.workers), 'worker')}, "
            f"{_count(len(self.servers), 'parameter server')}, {self.dispatched} dispatched by the chief (workers "
            "never wait for each other: no collectives, so no step table and no late worker)",
            f"{'worker':<10} {'functions':>9} {'mean ms':>8} {'pull':>7} {'push':>7} {'forward':>8} {'optimizer':>9} "
            f"{'other':>7} {'idle ms':>8} {'pulled':>10} {'pushed':>10}",
        ]
        for w in self.workers:
            n = max(1, w.functions)
            lines.append(
                f"{w.task:<10} {w.functions:>9} {w.mean_ms:>8.2f} {w.pull_ms / n:>7.2f} {w.push_ms / n:>7.2f} "
                f"{w.forward_ms / n:>8.2f} {w.optimizer_ms / n:>9.2f} {w.other_ms / n:>7.2f} {w.idle_ms:>8.1f} "
                f"{_size(w.pulled_bytes):>10} {_size(w.pushed_bytes):>10}"
            )
        lines.append("(pull .. other: ms per function, adding up to the mean; idle: between functions, in all)")
        for s in self.servers:
            mean = s.update_ms / s.updates if s.updates else 0.0
            lines.append(
                f"{s.task}: {s.updates} pushes applied, {mean:.2f} ms each (mean), {s.update_ms:.1f} ms in all"
            )
        lines.append("clocks (offset to the chief, error bound): " + ", ".join(
            f"{task} {c['offset_ms']:+.3f} ms ± {c['error_ms']:.3f}" for task, c in self.clocks.items()
        ))  # fmt: skip
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "parameter_server",
            "workers": [{**asdict(w), "mean_ms": round(w.mean_ms, 3)} for w in self.workers],
            "servers": [asdict(s) for s in self.servers],
            "dispatched": self.dispatched,
            "clocks": self.clocks,
        }


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _ms(ns: int) -> float:
    return round(ns / 1e6, 3)


def _label(span: Span) -> str | None:
    if span.category == "wait":
        return span.name if span.name in ("pull", "push") else None
    if span.category in ("forward", "optimizer"):
        return span.category
    return "other" if span.category == FUNCTION else None


def _paint(spans: list[tuple[int, int, str]]) -> dict[str, int]:
    """Nanoseconds of each of PARTS in `spans` (start, end, label), the label of highest priority winning."""
    priority = {label: i for i, label in enumerate(PARTS)}
    points = sorted({t for a, b, _ in spans for t in (a, b)})
    index = {t: i for i, t in enumerate(points)}
    best = [len(PARTS)] * max(0, len(points) - 1)
    for a, b, label in spans:
        for i in range(index[a], index[b]):
            best[i] = min(best[i], priority[label])
    totals = dict.fromkeys(PARTS, 0)
    for i, p in enumerate(best):
        if p < len(PARTS):
            totals[PARTS[p]] += points[i + 1] - points[i]
    return totals


def _worker(w: WorkerTrace) -> WorkerFunctions | None:
    functions = [s for s in w.spans if s.category == FUNCTION]
    if not functions:
        return None
    labelled = [(s.start, s.end, label) for s in w.spans if s.track == "functions" and (label := _label(s))]
    totals = _paint([(a, b, label) for a, b, label in labelled if b > a])
    first, last = min(s.start for s in functions), max(s.end for s in functions)
    busy = sum(totals.values())
    moved = {op: sum(int((s.args or {}).get("bytes", 0)) for s in w.spans if s.category == "rpc"
                     and (s.args or {}).get("op") == op) for op in ("pull", "push")}  # fmt: skip
    return WorkerFunctions(
        task=w.task,
        rank=w.rank,
        functions=len(functions),
        span_ms=_ms(last - first),
        functions_ms=_ms(busy),
        idle_ms=_ms(last - first - busy),
        pull_ms=_ms(totals["pull"]),
        push_ms=_ms(totals["push"]),
        forward_ms=_ms(totals["forward"]),
        optimizer_ms=_ms(totals["optimizer"]),
        other_ms=_ms(totals["other"]),
        pulled_bytes=moved["pull"],
        pushed_bytes=moved["push"],
    )


def summarize_functions(job: JobTrace) -> FunctionsSummary:
    """The report of a parameter-server job's trace (see the module docstring)."""
    workers = [row for w in job.workers if w.role != "ps" and (row := _worker(w)) is not None]
    servers = [
        ServerUpdates(w.task, w.rank, len(updates), _ms(sum(s.end - s.start for s in updates)))
        for w in job.workers
        if w.role == "ps"
        for updates in [[s for s in w.spans if s.category == "update"]]
    ]
    dispatched = sum(1 for w in job.workers for s in w.spans if s.category == "dispatch")
    clocks = {w.task: {"offset_ms": w.offset_ns / 1e6, "error_ms": w.error_ns / 1e6} for w in job.workers}
    return FunctionsSummary(workers, servers, dispatched, clocks)
