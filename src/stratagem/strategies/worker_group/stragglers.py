"""Stragglers named while training continues: each worker's phase times, compared across workers.

Each worker times the phases of its steps: input (fetching and cutting its batch), compute (from the
start of the step to the gradient sum: forward and backward) and communication (waiting for the
gradient sum, which is where a worker waits for a slower peer). The times of its last complete step
ride the gradient sum it makes anyway (`SLOT` numbers in a slot of its own, in milliseconds), so
every worker learns every worker's times at every step without another message.

The rule, on the last `window` steps, and holding at `confirm` steps in a row: a worker is slow when the median of its own work (input +
compute) exceeds the median of its peers' by at least `min_excess_s` AND by `relative` of the peers'
median step time (both, so that neither noise on fast steps nor a small lag on long steps is called
a straggler); the phase named is the one (input or compute) whose median exceeds its peers' most.
A worker whose communication alone is longer, while its own work is not shorter (so it does not just
wait for the others), is named slow in communication. Synchronous workers all wait for the slowest
one, so a straggler's peers show the excess as communication: the rule looks at own work first.

    >>> watch = StragglerWatch(rank=0, task_names=["worker:0", "worker:1"])
    >>> watch.observe(summed_slots, step=12)        # a `Straggler` once one is found, else None
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

PHASES = ("input", "compute", "communication")
SLOT = len(PHASES)
"""Numbers each worker sends per step: its last complete step's phase times, in milliseconds."""


@dataclass(frozen=True)
class Straggler:
    """A worker slower than its peers: which, in which phase, by how much (medians over the window)."""

    task: str
    rank: int
    phase: str
    excess_ms: float
    step: int
    times_ms: dict[str, dict[str, float]]
    """Every worker's median time per phase over the window, in ms: {task: {phase: ms}}."""
    detail: str | None = None
    """Within compute, the phase it is slow in (forward, backward, optimizer), where a trace shows it
    (`multi_worker/straggler_phases.py`); None otherwise."""

    def describe(self) -> str:
        mine = self.times_ms[self.task]
        peers = ", ".join(
            f"{task} {sum(t[p] for p in PHASES[:2]):.1f} ms of input+compute"
            for task, t in self.times_ms.items()
            if task != self.task
        )
        where = self.phase if self.detail is None else f"{self.phase} ({self.detail}, by the trace)"
        return (
            f"{self.task} (rank {self.rank}) is a straggler at step {self.step}: {self.excess_ms:.0f} ms a step "
            f"slower than its peers in {where} (medians over the last steps: {mine['input']:.1f} ms input, "
            f"{mine['compute']:.1f} ms compute, {mine['communication']:.1f} ms communication; {peers}). Every "
            "worker waits for it at each gradient sum; check that machine's load, its data loading, or its device."
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "rank": self.rank,
            "phase": self.phase,
            "excess_ms": round(self.excess_ms, 3),
            "step": self.step,
            "detail": self.detail,
            "median_ms": self.times_ms,
        }


class StepTimes:
    """This worker's phase times. Input and communication are added as they happen (`input_`,
    `communication_`); `summed`, after each step's gradient sum, closes the step: its compute is the rest of
    the time since the last `summed` (forward, backward, the optimizer and the loop's own work)."""

    def __init__(self) -> None:
        self._input = 0.0
        self._comm = 0.0
        self._mark: float | None = None
        self.last: tuple[float, float, float] | None = None
        """The last complete step's (input, compute, communication), in seconds."""

    def input_(self, seconds: float) -> None:
        self._input += seconds

    def communication_(self, seconds: float) -> None:
        self._comm += seconds

    def summed(self) -> None:
        """The step's gradient sum is done: its times are complete."""
        now = time.perf_counter()
        if self._mark is not None:
            period = now - self._mark
            self.last = (self._input, max(0.0, period - self._input - self._comm), self._comm)
        self._mark = now
        self._input = self._comm = 0.0


class StragglerWatch:
    """Every worker's phase times from the summed slots, and the rule that names a straggler."""

    def __init__(
        self,
        *,
        rank: int,
        task_names: Sequence[str],
        window: int = 10,
        confirm: int = 3,
        min_excess_s: float = 0.02,
        relative: float = 0.2,
    ) -> None:
        self.rank = rank
        self.task_names = list(task_names)
        self.world_size = len(self.task_names)
        self.window = window
        self.confirm = confirm
        self._streak: tuple[tuple[str, str] | None, int] = (None, 0)
        self.min_excess_s = min_excess_s
        self.relative = relative
        self._history: collections.deque[list[list[float]]] = collections.deque(maxlen=window)
        self.current: Straggler | None = None
        """The straggler named at the last step (None: none)."""
        self.named: list[Straggler] = []
        """Each straggler when first named (and again after it had recovered)."""

    @property
    def size(self) -> int:
        return SLOT * self.world_size

    def numbers(self, times: StepTimes) -> list[float]:
        """Every worker's slot, this worker's holding its last complete step's phase times (ms), the others zero."""
        out = [0.0] * self.size
        if times.last is not None:
            start = self.rank * SLOT
            out[start : start + SLOT] = [1000.0 * t for t in times.last]
        return out

    def observe(
        self, summed: Sequence[float], step: int, refine: Callable[[Straggler], Straggler] | None = None
    ) -> Straggler | None:
        """Takes one step's summed slots (every worker's last complete step, ms); returns a straggler newly
        named at this step, else None (`current` holds the one still named). `refine`: adds what else is known
        of a straggler found (the phase of compute, from a trace)."""
        per_worker = [list(summed[r * SLOT : (r + 1) * SLOT]) for r in range(self.world_size)]
        if any(not any(times) for times in per_worker):
            return None  # a worker has no complete step yet
        self._history.append(per_worker)
        if len(self._history) < self.window or self.world_size < 2:
            return None
        found = self.judge(step)
        if found is not None and refine is not None:
            found = refine(found)
        key = None if found is None else (found.task, found.phase)
        seen, count = self._streak
        self._streak = (key, count + 1 if key == seen else 1)
        if found is None:
            self.current = None
            return None
        if self._streak[1] < self.confirm:
            return None  # not yet held for `confirm` steps: the current one (if any) stays named
        newly = self.current is None or (self.current.task, self.current.phase) != key
        self.current = found
        if newly:
            self.named.append(found)
            return found
        return None

    def judge(self, step: int) -> Straggler | None:
        """The rule (see the module's docstring) on the history held."""
        medians = [
            [statistics.median(entry[r][p] for entry in self._history) for p in range(SLOT)]
            for r in range(self.world_size)
        ]
        times_ms = {self.task_names[r]: dict(zip(PHASES, m)) for r, m in enumerate(medians)}
        best: tuple[float, int, str] | None = None
        for r, mine in enumerate(medians):
            peers = [m for q, m in enumerate(medians) if q != r]
            peer_phase = [statistics.median(m[p] for m in peers) for p in range(SLOT)]
            peer_step = statistics.median(sum(m) for m in peers)
            threshold = max(1000.0 * self.min_excess_s, self.relative * peer_step)
            excess = [mine[p] - peer_phase[p] for p in range(SLOT)]
            own = excess[0] + excess[1]
            if own >= threshold:
                phase = PHASES[0] if excess[0] > excess[1] else PHASES[1]
                candidate = (own, r, phase)
            elif excess[2] >= threshold and own > -threshold / 2:
                candidate = (excess[2], r, PHASES[2])
            else:
                continue
            if best is None or candidate[0] > best[0]:
                best = candidate
        if best is None:
            return None
        excess_ms, r, phase = best
        return Straggler(self.task_names[r], r, phase, excess_ms, step, times_ms)
