"""Each worker's time painted into non-overlapping labelled pieces, the label of highest priority winning.

A wait for a collective is split at the moment the last worker arrived: before it the worker waited for a
peer ("peers"), after it the data moved ("transfer"). Waits win over input, input over the compute phases
(forward, backward, optimizer), those over the rest of a step ("compute": the loss, the user's own code);
time in no span is idle. Since the pieces do not overlap, the labels of any interval add up to its length.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # fold.py (the recorder's summary mode) reads the labels here; merge imports the recorder
    from stratagem.trace.merge import JobTrace, WorkerTrace

LABELS = ("peers", "transfer", "input", "forward", "backward", "optimizer", "compute")
"""By priority, highest first."""
PHASES = ("input", "forward", "backward", "optimizer", "compute", "idle")
"""What a worker does between collectives: the labels but the waits', and idle (`late.py`, `fold.py`)."""
PRIORITY = {label: i for i, label in enumerate(LABELS)}
"""Each label's priority, 0 the highest."""
_CATEGORY = {
    "input": "input",
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer",
    "step": "compute",
}


@dataclass
class Timeline:
    """Sorted, non-overlapping pieces (start, end, label) of one worker; idle between them."""

    starts: list[int]
    pieces: list[tuple[int, int, str]]

    def totals(self, start: int, end: int) -> dict[str, int]:
        """Nanoseconds of each label (and "idle") within [start, end)."""
        out = dict.fromkeys((*LABELS, "idle"), 0)
        covered = 0
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        while i < len(self.pieces) and self.pieces[i][0] < end:
            a, b, label = self.pieces[i]
            overlap = min(b, end) - max(a, start)
            if overlap > 0:
                out[label] += overlap
                covered += overlap
            i += 1
        out["idle"] = max(0, end - start - covered)
        return out


def last_arrivals(job: JobTrace) -> dict[int, int]:
    """For each collective's sequence number, when the last worker entered it (chief's clock, ns)."""
    last: dict[int, int] = {}
    for w in job.workers:
        for c in w.collectives:
            last[c.seq] = max(last.get(c.seq, c.arrived), c.arrived)
    return last


def paint(worker: WorkerTrace, last: dict[int, int]) -> Timeline:
    """The worker's timeline (see the module docstring); `last` from `last_arrivals`."""
    return paint_spans(((s.category, s.start, s.end, s.args) for s in worker.spans), last)


def paint_spans(spans: Iterable[tuple[str, int, int, dict[str, Any] | None]], last: dict[int, int]) -> Timeline:
    """The timeline of spans given as (category, start, end, args); a wait whose collectives are not in `last`
    is all transfer."""
    intervals: list[tuple[int, int, int]] = []  # (start, end, priority)
    for category, start, end, args in spans:
        if category == "wait":
            seqs = (args or {}).get("seqs", [])
            arrived = max((last[q] for q in seqs if q in last), default=start)
            split = min(max(arrived, start), end)
            intervals.append((start, split, PRIORITY["peers"]))
            intervals.append((split, end, PRIORITY["transfer"]))
        elif category in _CATEGORY:
            intervals.append((start, end, PRIORITY[_CATEGORY[category]]))
    points = sorted({t for a, b, _ in intervals if b > a for t in (a, b)})
    index = {t: i for i, t in enumerate(points)}
    # Each elementary interval takes the highest-priority (lowest) label of the intervals covering it. Spans
    # nest a few deep, so this visits each elementary interval a few times (and folds a step in summary mode
    # at half the cost of a sweep with open counts).
    none = len(LABELS)
    best = [none] * max(0, len(points) - 1)
    for a, b, p in intervals:
        if b > a:
            for i in range(index[a], index[b]):
                if p < best[i]:
                    best[i] = p
    pieces: list[tuple[int, int, str]] = []
    for i, p in enumerate(best):
        if p == none:
            continue
        t, nxt, label = points[i], points[i + 1], LABELS[p]
        if pieces and pieces[-1][2] == label and pieces[-1][1] == t:
            pieces[-1] = (pieces[-1][0], nxt, label)
        else:
            pieces.append((t, nxt, label))
    return Timeline([p[0] for p in pieces], pieces)
