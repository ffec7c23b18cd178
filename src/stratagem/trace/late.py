"""The late worker, named by its arrival at the collectives.

At each collective the worker that entered last made the others wait: by how much is its arrival less the
arrival before it. What it was doing meanwhile is read from the stretch since it left the collective
before: each phase's time (input, forward, backward, optimizer, the rest of the step, idle) there, less the
median of its peers' over their own stretch, and the phase of largest excess is the one it lost time in.
A step's late worker is the one whose waits made the others wait longest over the step's collectives.

A worker is named when, in a window of `window` steps, it was last in at least `share` of them, by a median
margin of at least `min_ms` and `relative` of the median step time (both, so that neither jitter on fast
steps nor a small lag on long ones names anyone).
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from stratagem.trace.merge import JobTrace
from stratagem.trace.timeline import PHASES

Stretch = Callable[[int, int, int, int], dict[str, int]]
"""``stretch(rank, seq, since, arrived)``: ns of each of `PHASES` on worker `rank` from `since` until it entered
collective `seq` at `arrived`."""


@dataclass(frozen=True)
class LateStep:
    """The worker the others waited for at one step: its task, how long they waited for it, its phase."""

    step: int
    task: str
    rank: int
    margin_ms: float
    phase: str


@dataclass(frozen=True)
class LateWorker:
    """A worker named late over a window of steps."""

    task: str
    rank: int
    phase: str
    margin_ms: float
    """Median over the window's steps at which it was last, in ms."""
    step: int
    """The step at which it was named."""
    share: float
    """The fraction of the window's steps at which it arrived last."""

    def describe(self) -> str:
        return (
            f"late worker: {self.task} (rank {self.rank}) arrived last at {self.share:.0%} of the steps up to step "
            f"{self.step}, {self.margin_ms:.1f} ms after the others (median), having spent the extra time in "
            f"{self.phase}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def late_steps(
    job: JobTrace, stretch: Stretch, windows: dict[int, dict[int, tuple[int, int]]], steps: list[int]
) -> list[LateStep]:
    """Each step's late worker (see the module docstring); `stretch` reads a worker's phases before a collective
    (from its painted timeline, or from what summary mode kept of it)."""
    world = len(job.workers)
    if world < 2:
        return []
    by_rank = {w.rank: {c.seq: c for c in w.collectives} for w in job.workers}
    tasks = {w.rank: w.task for w in job.workers}
    seqs = sorted(set.intersection(*(set(c) for c in by_rank.values())))
    per_step: dict[int, dict[int, float]] = {}  # step -> rank -> ns the others waited for it
    excess: dict[int, dict[int, dict[str, float]]] = {}
    step_of = {r: sorted((end, step, start) for step, (start, end) in windows[r].items()) for r in by_rank}
    for seq in seqs:
        arrivals = sorted((by_rank[r][seq].arrived, r) for r in by_rank)
        (second, _), (arrived, late) = arrivals[-2], arrivals[-1]
        step = next((s for end, s, start in step_of[late] if start < arrived <= end), None)
        if step is None or step not in windows[late]:
            continue
        waits = per_step.setdefault(step, {})
        waits[late] = waits.get(late, 0.0) + (arrived - second)
        phases: dict[int, dict[str, int]] = {}
        for r in by_rank:
            prev = by_rank[r].get(seq - 1)
            since = prev.done if prev is not None and prev.done is not None else windows[r].get(step, (0, 0))[0]
            since = min(since, by_rank[r][seq].arrived)
            phases[r] = stretch(r, seq, since, by_rank[r][seq].arrived)
        mine = excess.setdefault(step, {}).setdefault(late, {})
        for phase in PHASES:
            others = statistics.median(phases[r][phase] for r in by_rank if r != late)
            mine[phase] = mine.get(phase, 0.0) + phases[late][phase] - others
    out = []
    for step in steps:
        waited = per_step.get(step)
        if not waited:
            continue
        rank, ns = max(waited.items(), key=lambda kv: kv[1])
        counts = excess[step][rank]
        phase = max(PHASES, key=lambda p: counts[p])
        out.append(LateStep(step, tasks[rank], rank, round(ns / 1e6, 3), phase))
    return out


def name_late_workers(
    steps: list[LateStep],
    step_ms: dict[int, float],
    *,
    window: int = 10,
    share: float = 0.7,
    min_ms: float = 5.0,
    relative: float = 0.1,
) -> list[LateWorker]:
    """The late workers named over the steps, each when first named (again after it had recovered)."""
    recent: collections.deque[LateStep] = collections.deque(maxlen=window)
    named: list[LateWorker] = []
    current: tuple[str, str] | None = None
    for late in steps:
        recent.append(late)
        if len(recent) < window:
            continue
        counts = collections.Counter(s.rank for s in recent)
        rank, count = counts.most_common(1)[0]
        mine = [s for s in recent if s.rank == rank]
        margin = statistics.median(s.margin_ms for s in mine)
        typical = statistics.median(step_ms.get(s.step, 0.0) for s in recent)
        if count < share * window or margin < max(min_ms, relative * typical):
            current = None
            continue
        phase = collections.Counter(s.phase for s in mine).most_common(1)[0][0]
        key = (mine[0].task, phase)
        if key != current:
            named.append(LateWorker(mine[0].task, rank, phase, round(margin, 3), late.step, round(count / window, 2)))
            current = key
    return named
