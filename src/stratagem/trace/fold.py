"""Summary mode: each step's spans folded, as the step ends, into the little the step table needs.

A trace in full mode keeps every span (`recorder.py`); one in summary mode keeps, per step, its window (from the
end of the step before to its own end), the time of each label painted in it (`timeline.py`, every wait one
label), the waits themselves (start, end and collectives: the only part the split into waiting for peers and
transfer needs the other workers for), and, per collective, what this worker did in the stretch before it
entered it (the phases `late.py` compares). The spans are then dropped. `summary.py` makes the same table from
either; what differs is a stretch that began before the step before its collective, counted from that step's
start, and a collective not yet done at its step's end, whose successor's stretch starts at the window's start.

    >>> folder = StepFolder()
    >>> folder.fold(step, end, spans, collectives)   # the recorder calls it at the end of each step
"""

from __future__ import annotations

from typing import Any

from stratagem.trace.timeline import PHASES, Timeline, paint_spans

SPANS = "spans"
SUMMARY = "summary"
MODES = (SPANS, SUMMARY)
"""A trace's modes: every span kept, or the steps folded."""

FOLDED = ("input", "forward", "backward", "optimizer", "compute", "wait", "idle")
"""The labels of a folded step's totals ("wait": waiting for peers and transfer together)."""


class StepFolder:
    """The folded steps of one worker (the recorder's summary mode)."""

    def __init__(self) -> None:
        self.steps: list[list[Any]] = []
        """[step, window start, window end, [ns of each label of FOLDED], [[wait start, wait end, seqs], ...]]."""
        self.stretches: list[list[int]] = []
        """[collective's sequence number, ns of each of PHASES between the collective before it and its entry]."""
        self._window_start: int | None = None
        self._previous: Timeline | None = None
        self._next_seq = 0  # the first collective whose stretch is not yet folded

    def fold(self, step: int, end: int, spans: list[tuple[Any, ...]], collectives: list[list[Any]]) -> None:
        """Folds the window of `step`, which ended at `end`: `spans` are the recorder's since the last fold, as
        (category, name, start, end, track, step, args); `collectives` all of its collectives."""
        start = self._window_start
        if start is None:
            start = min((s[2] for s in spans), default=end)
        timeline = paint_spans(((s[0], s[2], s[3], s[6]) for s in spans), {})  # every wait painted "transfer"
        t = timeline.totals(start, end)
        totals = [t["peers"] + t["transfer"] if label == "wait" else t[label] for label in FOLDED]
        waits = [[s[2], s[3], (s[6] or {}).get("seqs", [])] for s in spans if s[0] == "wait"]
        self.steps.append([step, start, end, totals, waits])
        while self._next_seq < len(collectives) and collectives[self._next_seq][7] <= end:
            seq = self._next_seq
            arrived = collectives[seq][7]
            before = collectives[seq - 1][8] if seq > 0 else None
            since = min(start if before is None else before, arrived)
            phases = timeline.totals(max(since, start), arrived)
            if since < start and self._previous is not None:
                earlier = self._previous.totals(since, start)
                phases = {label: phases[label] + earlier[label] for label in phases}
            self.stretches.append([seq, *(phases[phase] for phase in PHASES)])
            self._next_seq += 1
        self._previous = timeline
        self._window_start = end
