"""torch.profiler and replica threads: how to see every replica, and the warning when only one is seen.

`MirroredStrategy` runs replica 0 on the caller's thread and the others on threads of its own.
torch.profiler registers its callbacks for the thread that starts it, so a plain
``torch.profiler.profile()`` records replica 0's operators only. Started with
``experimental_config=torch.profiler._ExperimentalConfig(profile_all_threads=True)`` it records
every thread, so every replica:

    config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        strategy.run(train_step, args=(x, y))

A profiler of the caller's thread only is visible to torch (``torch.autograd._profiler_enabled()``
is true on that thread alone), so a step with several replica threads under one logs a warning,
once per strategy, saying so and how to see them all.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

ONE_THREAD_WARNING = (
    "torch.profiler is recording this thread only, so it sees replica 0 of %d and none of the other replicas' "
    "threads. Start it with experimental_config=torch.profiler._ExperimentalConfig(profile_all_threads=True)."
)


def warn_if_profiling_one_thread(num_replicas: int, *, warned: bool) -> bool:
    """Logs `ONE_THREAD_WARNING`, unless the caller has `warned` already, when the caller's thread alone is
    being profiled; returns whether the caller has warned now (it keeps that, to warn once)."""
    if warned or num_replicas <= 1 or not torch.autograd._profiler_enabled():
        return warned
    logger.warning(ONE_THREAD_WARNING, num_replicas)
    return True
