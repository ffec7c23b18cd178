"""The digits job's own thread gets the intra-op threads of one CPU replica while it trains.

Under MirroredStrategy over two logical CPU devices (the default on a CPU-only machine) each replica
thread runs its part of a step with one intra-op thread (`explain()`: "intra-op threads per CPU
replica: 1"), and the job's own thread, which runs replica 0, gets its two threads back between steps.
The ops it runs there are tiny (the gather of the next batch from `ShuffledBatches`, the sum of the
replicas' metric states), yet each one woke the thread's second OpenMP worker, asleep since the last
step began, and that worker then spun on a core the replicas needed. Profiled on the 2-vCPU VM
(benchmarks/reports/2026-12-07-cpu-2vcpu-digits-job.md): the gather took a median 5.7-6.0 ms a step
against 0.08-0.14 ms with one thread, and the replicas' part 10 ms against 4.8-5.5 ms, so the job ran
at 0.4x one device. With the job's thread at the replicas' count the ops between steps run on it alone.

The numbers are unchanged: the gather copies, and the states summed there are two per step, added in
replica order whatever the thread count.

    >>> with threads_of_one_replica(strategy):       # doctest: +SKIP
    ...     fit(strategy, ...)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from stratagem.strategies import Strategy

THREADS_DECISION = "intra-op threads per CPU replica"
"""The subject of the decision (`Strategy.explain()`) that says how many intra-op threads each CPU replica uses."""


def replica_threads(strategy: Strategy) -> int | None:
    """The intra-op threads each of `strategy`'s CPU replicas uses, as its `explain()` says; None where it says
    nothing (no CPU replica, or a strategy that does not set them)."""
    decision = strategy.explain().decision(THREADS_DECISION)
    if decision is None or not decision.choice.isdigit():
        return None
    return int(decision.choice)


@contextlib.contextmanager
def threads_of_one_replica(strategy: Strategy) -> Iterator[int]:
    """This thread's intra-op threads at `replica_threads(strategy)` (never more than it has) for the block,
    restored after it; yields the count used."""
    before = torch.get_num_threads()
    wanted = replica_threads(strategy)
    threads = before if wanted is None else max(1, min(before, wanted))
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)
