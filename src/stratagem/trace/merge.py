"""The worker files of one trace, on the chief's clock, and the one Chrome trace-event file made of them.

`load(directory)` reads every `worker-<rank>.json` and shifts its times by the worker's measured offset
(`clocks.py`), so that all of them read the chief's clock. `chrome_trace(job)` lays them out for Perfetto
and chrome://tracing: one process per worker (named by its task), one thread per track (the training
thread, each replica thread, each transport), complete events ("X") in microseconds, and for every
collective a flow ("s" on the first worker to arrive, "t", "f" on the last) joining its span on each
worker, so the arrow ends at the worker the others waited for. Spans that carry the same `flow` argument (a
parameter server's dispatch on the chief and the function it ran on a worker) are joined the same way, in the
order they started. Besides the workers' files, a parameter-server job's are read (`ps-<i>.json`, `chief.json`).

    >>> job = load("traces/")
    >>> path = write_chrome_trace(job, "traces/trace.json.gz")
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stratagem.errors import InputError
from stratagem.trace.fold import FOLDED
from stratagem.trace.recorder import FORMAT
from stratagem.trace.timeline import PHASES

PROCESS_FILES = ("worker-*.json", "ps-*.json", "chief.json")
"""The files of a trace's processes in its directory: every worker's, and a parameter-server job's others."""


@dataclass
class Span:
    category: str
    name: str
    start: int
    end: int
    track: str
    step: int
    args: dict[str, Any] | None


@dataclass
class Collective:
    seq: int
    op: str
    what: str
    step: int
    nbytes: int
    bucket: int | None
    transport: str
    arrived: int
    done: int | None


@dataclass
class FoldedStep:
    """One step of a trace in summary mode (`fold.py`): its window, the ns of each label in it, its waits."""

    step: int
    start: int
    end: int
    totals: dict[str, int]
    waits: list[tuple[int, int, list[int]]]
    """(start, end, the collectives waited for)."""


@dataclass
class WorkerTrace:
    """One worker's spans and collectives, its times on the chief's clock (ns)."""

    rank: int
    task: str
    offset_ns: int
    error_ns: int
    spans: list[Span] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)
    mode: str = "spans"
    """"summary": the steps were folded as they ended (`steps`, `stretches`), and `spans` holds none of them."""
    steps: list[FoldedStep] = field(default_factory=list)
    stretches: dict[int, dict[str, int]] = field(default_factory=dict)
    """Summary mode: collective's sequence number -> ns of each phase in the stretch before this worker entered it."""
    role: str = "worker"
    """"worker", or in a parameter-server job "ps" or "chief" (`Recorder.role`)."""


@dataclass
class JobTrace:
    """Every worker's trace, ordered by rank, on one clock."""

    workers: list[WorkerTrace]

    @property
    def origin(self) -> int:
        """The earliest time of any event: the merged file's zero."""
        times = (
            [s.start for w in self.workers for s in w.spans]
            + [c.arrived for w in self.workers for c in w.collectives]
            + [s.start for w in self.workers for s in w.steps]
        )
        return min(times) if times else 0


def load(directory: str | Path) -> JobTrace:
    """Every worker's file in `directory`, its times moved onto the chief's clock."""
    files = [path for pattern in PROCESS_FILES for path in Path(directory).glob(pattern)]
    if not files:
        raise InputError(
            f"No worker trace files in the directory. Received: {str(directory)!r}. Give the directory passed to "
            "--trace (or to strategy.trace()), after the job has ended."
        )
    workers = []
    for path in files:
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT:
            raise InputError(f"{path} is not a stratagem worker trace. Received: format={raw.get('format')!r}.")
        workers.append(worker_trace(raw))
    return JobTrace(sorted(workers, key=lambda w: w.rank))


def worker_trace(raw: dict[str, Any]) -> WorkerTrace:
    """One worker's file's contents (`Recorder.to_dict`), its times moved onto the chief's clock."""
    shift = int(raw["clock"]["offset_ns"])
    worker = WorkerTrace(
        raw["rank"], raw["task"], shift, int(raw["clock"]["error_ns"]), mode=raw.get("mode", "spans"),
        role=raw.get("role", "worker"),
    )  # fmt: skip
    for step, start, end, totals, waits in raw.get("steps", []):
        worker.steps.append(
            FoldedStep(step, start + shift, end + shift, dict(zip(FOLDED, totals)),
                       [(a + shift, b + shift, q) for a, b, q in waits])
        )  # fmt: skip
    worker.stretches = {seq: dict(zip(PHASES, phases)) for seq, *phases in raw.get("stretches", [])}
    for cat, name, start, end, track, step, args in raw["spans"]:
        worker.spans.append(Span(cat, name, start + shift, end + shift, track, step, args))
    for seq, op, what, step, nbytes, bucket, transport, arrived, done in raw["collectives"]:
        worker.collectives.append(
            Collective(seq, op, what, step, nbytes, bucket, transport, arrived + shift,
                       None if done is None else done + shift)
        )  # fmt: skip
    return worker


def _us(ns: int) -> float:
    return round(ns / 1000.0, 3)


def chrome_trace(job: JobTrace) -> dict[str, Any]:
    """The Chrome trace-event document (see the module docstring)."""
    origin = job.origin
    events: list[dict[str, Any]] = []
    placed: dict[tuple[int, int], tuple[int, float]] = {}  # (rank, seq) -> (tid, ts) of its transport span
    flowing: dict[str, list[tuple[int, dict[str, Any]]]] = {}  # a span's `flow` argument -> (start, its event)
    for w in job.workers:
        pid = w.rank
        tids: dict[str, int] = {}

        def tid_of(track: str, pid: int = pid, tids: dict[str, int] = tids) -> int:
            if track not in tids:
                tids[track] = len(tids) + 1
                events.append(
                    {"ph": "M", "name": "thread_name", "pid": pid, "tid": tids[track], "args": {"name": track}}
                )
                events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tids[track], "args": {"sort_index": tids[track]}})  # fmt: skip
            return tids[track]

        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": w.task}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
        tid_of("main")
        # Longer spans first at one start, so that a parent precedes its children.
        for s in sorted(w.spans, key=lambda s: (s.track, s.start, -s.end)):
            args = {"step": s.step, **(s.args or {})}
            events.append({"ph": "X", "cat": s.category, "name": s.name, "pid": pid, "tid": tid_of(s.track),
                           "ts": _us(s.start - origin), "dur": _us(max(0, s.end - s.start)), "args": args})  # fmt: skip
            if "flow" in args:
                flowing.setdefault(str(args["flow"]), []).append((s.start, events[-1]))
        # A transport runs its collectives one after another: each span starts when this worker entered it, or
        # when the one before it ended (its arrival stays in its arguments).
        busy_until: dict[str, int] = {}
        for c in sorted(w.collectives, key=lambda c: c.seq):
            track = f"transport: {c.transport}"
            start = max(c.arrived, busy_until.get(track, c.arrived))
            end = max(start, c.done if c.done is not None else start)
            busy_until[track] = end
            tid = tid_of(track)
            ts = _us(start - origin)
            placed[(w.rank, c.seq)] = (tid, ts)
            name = c.what if c.bucket is None else f"{c.what} (bucket {c.bucket})"
            args = {"seq": c.seq, "op": c.op, "bytes": c.nbytes, "step": c.step, "arrived_us": _us(c.arrived - origin)}
            if c.bucket is not None:
                args["bucket"] = c.bucket
            events.append({"ph": "X", "cat": "collective", "name": name, "pid": w.rank, "tid": tid, "ts": ts,
                           "dur": _us(end - start), "args": args})  # fmt: skip
    events += _flows(job, placed)
    events += _span_flows(flowing, first_id=1 + max((seq for _, seq in placed), default=-1))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "source": "stratagem trace",
            "clock_offsets_ns": {w.task: {"offset": w.offset_ns, "error": w.error_ns} for w in job.workers},
        },
    }


def _flows(job: JobTrace, placed: dict[tuple[int, int], tuple[int, float]]) -> list[dict[str, Any]]:
    """One flow per collective seen on at least two workers, in the order the workers arrived."""
    by_seq: dict[int, list[tuple[int, Collective]]] = {}
    for w in job.workers:
        for c in w.collectives:
            by_seq.setdefault(c.seq, []).append((w.rank, c))
    events = []
    for seq, entries in sorted(by_seq.items()):
        if len(entries) < 2:
            continue
        entries.sort(key=lambda e: e[1].arrived)
        for i, (rank, c) in enumerate(entries):
            tid, ts = placed[(rank, seq)]
            phase = "s" if i == 0 else ("f" if i == len(entries) - 1 else "t")
            event = {"ph": phase, "cat": "collective", "name": c.what, "id": seq, "pid": rank, "tid": tid, "ts": ts}
            if phase != "s":
                event["bp"] = "e"  # bound to the span that encloses it, on its own track
            events.append(event)
    return events


def _span_flows(flowing: dict[str, list[tuple[int, dict[str, Any]]]], first_id: int) -> list[dict[str, Any]]:
    """One flow per `flow` argument that two spans or more carry, through them in the order they started; its ids
    follow the collectives'."""
    events = []
    for offset, (key, spans) in enumerate(sorted(flowing.items())):
        if len(spans) < 2:
            continue
        spans.sort(key=lambda entry: entry[0])
        for i, (_, span) in enumerate(spans):
            phase = "s" if i == 0 else ("f" if i == len(spans) - 1 else "t")
            event = {"ph": phase, "cat": "flow", "name": key, "id": first_id + offset, "pid": span["pid"],
                     "tid": span["tid"], "ts": span["ts"]}  # fmt: skip
            if phase != "s":
                event["bp"] = "e"
            events.append(event)
    return events


def write_chrome_trace(job: JobTrace, path: str | Path) -> Path:
    """Writes `chrome_trace(job)` to `path` (gzip-compressed when it ends in .gz); returns the path."""
    path = Path(path)
    data = json.dumps(chrome_trace(job), separators=(",", ":")).encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def merge(directory: str | Path, out: str | Path | None = None) -> Path:
    """The worker files of `directory` merged into `out` (default: `directory`/trace.json.gz)."""
    return write_chrome_trace(load(directory), Path(directory) / "trace.json.gz" if out is None else out)
