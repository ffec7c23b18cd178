"""Summary mode: the steps' spans folded, a batch of steps at a time, into the little the step table needs.

A trace in full mode keeps every span (`recorder.py`); one in summary mode keeps, per step, its window (from the
end of the step before to its own end), the time of each label painted in it (`timeline.py`, every wait one
label, each step painted from its own spans), the waits themselves (start, end and collectives: the only part the
split into waiting for peers and transfer needs the other workers for), and, per collective, what this worker did
in the stretch before it entered it (the phases `late.py` compares). `summary.py` makes the same table from
either; what differs is a stretch that began before the step before its collective, counted from that step's
start, and a collective not yet done at its step's end, whose successor's stretch starts at the window's start.

The training thread only appends: a tuple per span (category, start, end, a wait's collectives) and one per step's
end. The steps are folded together, with
numpy, every `BATCH` steps and whenever the folded steps are read (`steps`, `stretches`, the recorder's file):
folding a step at its end cost about 50 us of Python a step, several percent of a millisecond step
(benchmarks/reports/). The result is the same integers as painting each step alone (tests/test_trace_fold.py).

    >>> folder = StepFolder(collectives)      # the recorder's list of collectives, appended to as they come
    >>> folder.spans.append(("step", start, end, None)); folder.end_step(step, end)
    >>> folder.steps, folder.stretches        # every step ended so far, folded
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from stratagem.trace.timeline import LABELS, PHASES, PRIORITY

SPANS = "spans"
SUMMARY = "summary"
MODES = (SPANS, SUMMARY)
"""A trace's modes: every span kept, or the steps folded."""

FOLDED = ("input", "forward", "backward", "optimizer", "compute", "wait", "idle")
"""The labels of a folded step's totals ("wait": waiting for peers and transfer together)."""

BATCH = 512
"""Steps folded at once (and so kept as spans at most, besides those not yet read)."""

_WAIT = PRIORITY["transfer"]  # a wait not split at the last arrival is all transfer
_CODES = {"wait": _WAIT, "input": PRIORITY["input"], "forward": PRIORITY["forward"],
          "backward": PRIORITY["backward"], "optimizer": PRIORITY["optimizer"], "step": PRIORITY["compute"]}  # fmt: skip
_NONE = len(LABELS)
_COLUMNS = [LABELS.index(label) for label in ("input", "forward", "backward", "optimizer", "compute")]
_STRETCH = [LABELS.index(phase) for phase in PHASES if phase != "idle"]

OWN = ("forward", "backward", "optimizer")
"""The phases of compute the straggler warning is refined with (`last_phases`)."""
_OWN_CODES = {"wait": 0, "input": 1, "forward": 2, "backward": 3, "optimizer": 4}  # by priority, as LABELS


class StepFolder:
    """The steps of one worker in summary mode: appended as they run, folded in batches (module docstring).

    The folded steps are kept as numpy arrays, which the garbage collector does not track: a trace that keeps
    Python containers alive makes the collector's full passes over torch's heap come sooner.

    Args:
        collectives: the recorder's collectives, [seq, op, what, step, bytes, bucket, transport, arrived, done].
    """

    def __init__(self, collectives: list[list[Any]]) -> None:
        self.collectives = collectives
        self.spans: list[tuple[str, int, int, list[int] | None]] = []
        """The spans since the last fold, appended by the recorder's `span` (one append: several replica threads
        record at once): category, start and end (ns), and a wait's collectives (None for the others)."""
        # Per step not yet folded: step, end, spans, collectives, and its window's start when the step before it was
        # not recorded (a sampled trace, `begin_window`; None: the end of the step before).
        self._ends: list[tuple[int, int, int, int, int | None]] = []
        self._rows: list[np.ndarray] = []  # per batch: step, window start, window end, the totals of FOLDED
        self._waits: list[np.ndarray] = []  # per batch: the step's row, start, end, how many collectives
        self._wait_seqs: list[np.ndarray] = []  # per batch: the collectives of its waits, one after another
        self._stretches: list[np.ndarray] = []  # per batch: seq, the ns of each of PHASES
        self._previous: list[tuple[str, int, int, list[int] | None]] = []  # the last folded step's spans
        self._window_start: int | None = None
        self._opened: int | None = None  # `begin_window`'s time, for the next step to end
        self._next_seq = 0  # the first collective whose stretch is not yet folded
        self._folded = 0  # steps folded

    def begin_window(self, start: int) -> None:
        """The next step's window opens at `start` (ns), the end of a step that was not recorded (a sampled trace,
        `sample.py`): its stretches reach back no further, and no earlier span is painted into it."""
        self._opened = start

    def end_step(self, step: int, end: int) -> None:
        """`step` ended at `end` (its step span is the last added); folds a batch when one is full."""
        self._ends.append((step, end, len(self.spans), len(self.collectives), self._opened))
        self._opened = None
        if len(self._ends) >= BATCH:
            self.fold()

    @property
    def steps(self) -> list[list[Any]]:
        """[step, window start, window end, [ns of each label of FOLDED], [[wait start, wait end, seqs], ...]],
        for every step ended so far (made when read)."""
        self.fold()
        out = [[step, start, end, totals, []] for step, start, end, *totals in _stack(self._rows, 3 + len(FOLDED))]
        seqs = _stack(self._wait_seqs, 0)
        at = 0
        for row, start, end, count in _stack(self._waits, 4):
            out[row][4].append([start, end, seqs[at : at + count]])
            at += count
        return out

    @property
    def stretches(self) -> list[list[int]]:
        """[collective's sequence number, ns of each of PHASES between the collective before it and its entry]."""
        self.fold()
        return _stack(self._stretches, 1 + len(PHASES))

    def last_phases(self) -> dict[str, int] | None:
        """The last ended step's ns of own work in forward, backward and the optimizer step (waits and input painted
        over them), or None before one; worked out from its spans alone, without folding the batch (the straggler
        warning asks at every step)."""
        if not self._ends:
            return dict(zip(OWN, self._rows[-1][-1, 4:7].tolist())) if self._rows else None
        _, end, upto, _, opened = self._ends[-1]
        since = self._ends[-2][2] if len(self._ends) > 1 else 0
        start = self._ends[-2][1] if len(self._ends) > 1 else self._window_start
        if opened is not None:
            start = opened
        spans = self.spans[since:upto]
        if start is None:
            start = min((s[1] for s in spans), default=end)
        return own_phases(spans, start, end)

    def fold(self) -> None:
        """Folds every ended step not yet folded, as if each had been painted alone at its end."""
        ends = self._ends
        if not ends:
            return
        n, cut = len(ends), ends[-1][2]
        # Group 0: the last folded step (read by the stretches that reach back into it); group k: the k-th step here.
        previous, mine = self._previous, self.spans[:cut]
        del self.spans[:cut]
        self._previous = mine[ends[-2][2] :] if n > 1 else mine
        self._ends = []
        categories, starts_t, stops_t, seqs_t = zip(*(previous + mine))
        starts = np.array(starts_t, dtype=np.int64)
        stops = np.array(stops_t, dtype=np.int64)
        bounds = [0, len(previous)] + [len(previous) + e[2] for e in ends]
        group = np.repeat(np.arange(n + 1), np.diff(bounds))
        codes = np.array([_CODES.get(c, -1) for c in categories], dtype=np.int64)

        # The windows, the stretches, and so the queries: (group, from, to).
        windows: list[tuple[int, int]] = []
        stretch_queries: list[tuple[int, int, int, int, int]] = []  # seq, group, from, to, and from earlier or -1
        collectives = self.collectives
        seq = self._next_seq
        has_previous = self._window_start is not None
        for k, (_, end, _, count, opened) in enumerate(ends, start=1):
            if opened is not None:  # the step before was not recorded: nothing before the window belongs to it
                start = opened
            elif k > 1:
                start = ends[k - 2][1]
            elif self._window_start is not None:
                start = self._window_start
            else:
                start = int(starts[bounds[1] : bounds[2]].min()) if bounds[2] > bounds[1] else end
            windows.append((start, end))
            while seq < count and collectives[seq][7] <= end:
                arrived = collectives[seq][7]
                before = collectives[seq - 1][8] if seq > 0 else None
                if before is not None and before > end:  # done after this step ended: not done when it was folded
                    before = None
                if opened is not None and before is not None and before < start:  # a step not recorded between
                    before = None
                since = min(start if before is None else before, arrived)
                earlier = since if since < start and (k > 1 or has_previous) else -1
                stretch_queries.append((seq, k, max(since, start), arrived, earlier))
                seq += 1
        self._next_seq = seq
        back = [q for q in stretch_queries if q[4] >= 0]
        q_group = list(range(1, n + 1)) + [q[1] for q in stretch_queries] + [q[1] - 1 for q in back]
        q_from = [w[0] for w in windows] + [q[2] for q in stretch_queries] + [q[4] for q in back]
        q_to = [w[1] for w in windows] + [q[3] for q in stretch_queries] + [windows[q[1] - 1][0] for q in back]
        totals = _totals(group, codes, starts, stops, np.array(q_group, dtype=np.int64),
                         np.array(q_from, dtype=np.int64), np.array(q_to, dtype=np.int64))  # fmt: skip

        steps = totals[:n]
        rows = np.empty((n, 3 + len(FOLDED)), dtype=np.int64)
        rows[:, 0] = [e[0] for e in ends]
        rows[:, 1:3] = windows
        rows[:, 3:8] = steps[:, _COLUMNS]
        rows[:, 8] = steps[:, 0] + steps[:, 1]
        rows[:, 9] = steps[:, _NONE]
        self._rows.append(rows)
        m = len(stretch_queries)
        stretches = np.empty((m, 1 + len(PHASES)), dtype=np.int64)
        stretches[:, 0] = [q[0] for q in stretch_queries]
        stretches[:, 1:] = totals[n : n + m][:, _STRETCH + [_NONE]]
        if back:
            stretches[[i for i, q in enumerate(stretch_queries) if q[4] >= 0], 1:] += totals[n + m :][
                :, _STRETCH + [_NONE]
            ]
        self._stretches.append(stretches)
        # Each step's waits, as they were recorded: the step's row (counted from the first step folded), start, end.
        waits = [i for i in np.flatnonzero(codes[len(previous) :] == _WAIT).tolist() if mine[i][0] == "wait"]
        seqs = [seqs_t[len(previous) + i] or [] for i in waits]
        at = np.array(waits, dtype=np.int64) + len(previous)
        self._waits.append(
            np.stack([group[at] - 1 + self._folded, starts[at], stops[at],
                      np.array([len(s) for s in seqs], dtype=np.int64)], axis=1)
        )  # fmt: skip
        self._wait_seqs.append(np.array([q for s in seqs for q in s], dtype=np.int64))
        self._folded += n
        self._window_start = ends[-1][1]


def _stack(arrays: list[np.ndarray], width: int) -> list[Any]:
    """The batches' arrays one after another, as lists of Python ints."""
    if not arrays:
        return []
    return np.concatenate(arrays).tolist() if width == 0 else np.concatenate(arrays).reshape(-1, width).tolist()


def _totals(
    group: np.ndarray, codes: np.ndarray, starts: np.ndarray, stops: np.ndarray,
    q_group: np.ndarray, q_from: np.ndarray, q_to: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """Per query, ns of each of LABELS and idle (the last column) in [from, to) of its group's timeline, each group
    painted from its own spans: every elementary interval between the group's span ends takes the highest-priority
    label of the spans over it (as `timeline.paint_spans`), and the queries' ends split those intervals."""
    keep = (codes >= 0) & (stops > starts)
    ig, ia, ib, ip = group[keep], starts[keep], stops[keep], codes[keep]
    m, q = len(ia), len(q_from)
    out = np.zeros((q, _NONE + 1), dtype=np.int64)
    if q == 0:
        return out
    g_all = np.concatenate([ig, ig, q_group, q_group])
    t_all = np.concatenate([ia, ib, q_from, q_to])
    order = np.lexsort((t_all, g_all))
    gs, ts = g_all[order], t_all[order]
    new = np.ones(len(ts), dtype=bool)
    new[1:] = (gs[1:] != gs[:-1]) | (ts[1:] != ts[:-1])
    uid = np.empty(len(ts), dtype=np.int64)
    uid[order] = np.cumsum(new) - 1
    ug, ut = gs[new], ts[new]
    points = len(ut)
    length = np.zeros(points, dtype=np.int64)  # of the elementary interval from each point to the next of its group
    length[:-1] = np.where(ug[1:] == ug[:-1], ut[1:] - ut[:-1], 0)
    best = np.full(points, _NONE, dtype=np.int64)
    a_id, b_id = uid[:m], uid[m : 2 * m]
    for p in range(_NONE - 1, -1, -1):  # lowest priority first: a higher one overwrites it
        mine = ip == p
        if mine.any():
            opened = np.bincount(a_id[mine], minlength=points + 1) - np.bincount(b_id[mine], minlength=points + 1)
            best[np.cumsum(opened)[:points] > 0] = p
    prefix = np.zeros((points + 1, _NONE + 1), dtype=np.int64)
    prefix[np.arange(points) + 1, best] = length
    prefix = np.cumsum(prefix, axis=0)
    qa, qb = uid[2 * m : 2 * m + q], uid[2 * m + q :]
    out = prefix[qb] - prefix[qa]
    out[:, _NONE] = (q_to - q_from) - out[:, :_NONE].sum(axis=1)
    out[q_to <= q_from] = 0
    np.maximum(out, 0, out=out)
    return out


def own_phases(spans: Iterable[tuple[Any, ...]], start: int, end: int) -> dict[str, int]:
    """Ns of each of OWN in [start, end) as `timeline.paint_spans` labels them: one sweep over the spans of the labels
    above "compute" (the rest of a step cannot take time from these), clipped to the window first, which leaves
    every point inside it covered by the same spans. Each end is one int (time, opening, label) to sort."""
    keys: list[int] = []
    add, code_of = keys.append, _OWN_CODES.get
    for span in spans:
        code = code_of(span[0])
        if code is not None:
            a, b = span[1], span[2]
            if a < start:
                a = start
            if b > end:
                b = end
            if b > a:
                add(a << 4 | 8 | code)
                add(b << 4 | code)
    keys.sort()
    open_ = [0, 0, 0, 0, 0]
    own = [0, 0, 0, 0, 0]
    last = start
    for key in keys:
        t = key >> 4
        if t > last:
            for label in range(5):
                if open_[label]:
                    own[label] += t - last
                    break
            last = t
        open_[key & 7] += 1 if key & 8 else -1
    return {"forward": own[2], "backward": own[3], "optimizer": own[4]}
