"""`Traceable`: what a strategy declares when it can record its steps into a job's trace.

`fit(..., trace=DIR)` and `stratagem train --trace DIR` trace any strategy that is a `Traceable` and refuse the
others before any work, naming the ones that are. A strategy implements one member, `trace(directory)`: a
context manager inside which every process of the job records its steps, and at whose end each writes its
own `worker-<rank>.json` in `directory` (the format `recorder.py` writes and `merge.py` reads).

    >>> isinstance(strategy, Traceable)
    True
    >>> with strategy.trace("traces/"):
    ...     strategy.run(train_step, args=(x, y))
"""

from __future__ import annotations

import abc
from contextlib import AbstractContextManager
from pathlib import Path

from stratagem.trace.recorder import Clock, Recorder


class Traceable(abc.ABC):
    """A strategy whose steps can be traced (docs/trace.md)."""

    @abc.abstractmethod
    def trace(
        self, directory: str | Path, *, clock: Clock | None = None, mode: str = "spans"
    ) -> AbstractContextManager[Recorder]:
        """Records the steps run inside the block on every process of the job and writes each process's file,
        `directory`/worker-<rank>.json, at its end. Every process enters the block at the same point.
        `clock`: the nanosecond clock of the spans (default time.perf_counter_ns); `mode`: "spans" (every span)
        or "summary" (each step folded as it ends into what the step table needs, `fold.py`)."""
