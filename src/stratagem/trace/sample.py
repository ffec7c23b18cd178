"""Summary mode left on: a sample of the steps recorded, at a rate that keeps its cost near 1% of the step.

A step recorded in summary mode costs a fixed amount of Python on the training thread (the hooks' clock reads
and appends, the start-of-backward hook, the collectives' bookkeeping, the fold; 40-65 us of CPU a step on this
project's 2-core test machine, benchmarks/reports/2026-12-08-cpu-2vcpu-trace-overhead.md), which is 0.5% of a
10 ms step but 7-12% of a half-millisecond one. `fit` records every step of a slow run and 1 step in `every` of a
fast one: after each recorded step, `every` becomes the least power of two for which `COST_NS / every` is at most
`BUDGET` of that step's length (the lesser of its window's wall time and the training thread's CPU time in it),
and at least doubles after every `KEEP` recorded steps, so that a long run's memory stays bounded. The next step
recorded is the next multiple of `every`. A step not recorded costs a flag read in each hook (`Recorder.on`, off)
and a few attribute reads at its end (`Recorder.after_step`). The rule depends only on the recorded steps'
lengths, so a test drives it with fake clocks (tests/test_trace_sample.py).

What a sample keeps: each recorded step whole (its window, from the end of the step before it, recorded or not,
to its end; its input, forward, backward, optimizer step, waits and collectives). What it loses: the steps in
between, so a table of sampled steps is a survey, not a record of every step; the late worker is judged over
the recorded steps, and the straggler warning's phases (`Recorder.last_step_phases`) are those of the last
recorded step. An explicit trace (`fit(trace=DIR)`, `strategy.trace(DIR, ...)`, `stratagem launch --trace`)
records every step.

    >>> sample = StepSample(start=clock(), cpu_start=time.thread_time_ns())
    >>> on = sample.next_records(step, recorded=on, now=clock(), cpu_now=time.thread_time_ns())  # a step's end
"""

from __future__ import annotations

COST_NS = 100_000
"""What recording one step in summary mode costs, in ns of CPU: summary mode on every step measured +48 to +83 us of
CPU a step on the MLP job of benchmarks/trace_overhead.py (2-core machine, load 3-6), rounded up, since a loaded
machine (and a peer spinning while it waits) makes a recorded step cost more than a quiet one."""

BUDGET = 0.01
"""The share of a step's time the sampled recording may cost."""

MAX_EVERY = 1024
"""The sparsest sample: 1 step in this many (a step of under 10 us would need more)."""

KEEP = 4096
"""Recorded steps after which the interval is at least doubled, and again after each as many: what a long run keeps
in memory grows with the logarithm of its steps (about 41,000 recorded steps before 1 in 1,024, some tens
of MB), not with the steps."""


def sample_every(window_ns: int, *, cost_ns: int = COST_NS, budget: float = BUDGET) -> int:
    """The least power of two `k` (at most MAX_EVERY) with `cost_ns / k <= budget * window_ns`.

    Example:
        >>> sample_every(10_000_000), sample_every(600_000)     # a 10 ms step, a 0.6 ms step
        (1, 32)
    """
    every = 1
    while every < MAX_EVERY and cost_ns > budget * window_ns * every:
        every *= 2
    return every


class StepSample:
    """Which steps a trace left on records (module docstring). `start`: the clock's time the trace began.

    Args:
        start: ns of the recorder's clock when recording began (the first recorded step's window opens there).
        cost_ns, budget: `sample_every`'s.
        keep: `KEEP`.
    """

    def __init__(
        self, *, start: int, cpu_start: int = 0, cost_ns: int = COST_NS, budget: float = BUDGET, keep: int = KEEP
    ) -> None:
        self.cost_ns = cost_ns
        self.budget = budget
        self.keep = keep
        self.every = 1
        """The interval chosen after the last recorded step."""
        self.num_steps = 0
        """Steps ended since the trace began."""
        self.num_recorded = 0
        """Of those, the steps recorded."""
        self.next_step = 0
        """The next step to record (0: the next step whatever its number; steps are numbered from 1)."""
        self._opened = start  # when the window of the step under way (if recorded) opened
        self._cpu_opened = cpu_start  # the training thread's CPU time then

    def next_records(self, step: int, *, recorded: bool, now: int, cpu_now: int = 0) -> bool:
        """Step `step` ended at `now` (`recorded`: whether it was recorded; `cpu_now`: the training thread's CPU ns,
        0 if unknown); returns whether step `step + 1` is. A recorded step's length is the lesser of its wall time
        and its thread's CPU time: on a loaded machine, or waiting for a peer, the wall time grows but what the
        recording costs is CPU, and its share of the step's CPU is what would grow."""
        self.num_steps += 1
        if recorded:
            self.num_recorded += 1
            length = now - self._opened
            if cpu_now > self._cpu_opened:
                length = min(length, cpu_now - self._cpu_opened)
            least = min(MAX_EVERY, 1 << min(self.num_recorded // self.keep, 10))  # memory: see KEEP
            self.every = max(least, sample_every(length, cost_ns=self.cost_ns, budget=self.budget))
            # The next multiple of `every`: workers that chose different intervals (each from its own steps) then
            # record nested sets of steps, so a job pays for the densest worker's sample alone (a step one worker
            # records, its peers wait for at the next collective, spending the same time spinning or asleep).
            self.next_step = (step // self.every + 1) * self.every
        if step + 1 >= self.next_step:
            self._opened, self._cpu_opened = now, cpu_now
            return True
        return False

    def to_dict(self) -> dict[str, int | float]:
        return {
            "num_steps": self.num_steps,
            "num_recorded": self.num_recorded,
            "every": self.every,
            "cost_ns": self.cost_ns,
            "budget": self.budget,
        }
