"""`Traceable`: what a strategy declares when it can record its steps into a job's trace.

`fit(..., trace=DIR)` and `stratagem train --trace DIR` trace any strategy that is a `Traceable` and refuse the
others before any work, naming the ones that are. A strategy implements one member, `trace(directory)`: a
context manager inside which every process of the job records its steps, and at whose end each writes its
own `worker-<rank>.json` in `directory` (the format `recorder.py` writes and `merge.py` reads). A strategy of
one process implements it with `record_alone`.

    >>> isinstance(strategy, Traceable)
    True
    >>> with strategy.trace("traces/"):
    ...     strategy.run(train_step, args=(x, y))
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import ClassVar

from stratagem.errors import InputError
from stratagem.trace.recorder import Clock, Recorder, check_mode


class Traceable(abc.ABC):
    """A strategy whose steps can be traced (docs/trace.md)."""

    writes_every_file: ClassVar[bool] = False
    """True when the end of `trace()` returns only once every process of the job has written its file (the
    parameter server's chief stops each task's trace and waits for its reply); False: each process writes its own
    as it leaves the block, and `fit` meets the others at a barrier before the chief merges them."""

    samples_steps: ClassVar[bool] = False
    """True when the strategy ends every step, recorded or not, with `Recorder.after_step(step)` (the step just
    ended, numbered from 1) and its hooks read `Recorder.on` before any other work: a trace in summary mode can then
    record a sample of the steps (`Recorder.sample_steps`), and `fit` leaves one on by default. False: `fit` leaves
    the strategy untraced unless given a directory."""

    @abc.abstractmethod
    def trace(
        self, directory: str | Path, *, clock: Clock | None = None, mode: str = "spans"
    ) -> AbstractContextManager[Recorder]:
        """Records the steps run inside the block on every process of the job and writes each process's file,
        `directory`/worker-<rank>.json, at its end. Every process enters the block at the same point.
        `clock`: the nanosecond clock of the spans (default time.perf_counter_ns); `mode`: "spans" (every span)
        or "summary" (the steps folded in batches into what the step table needs, `fold.py`)."""


@contextlib.contextmanager
def record_alone(
    recorder: Recorder, directory: str | Path, *, clock: Clock | None = None, mode: str = "spans"
) -> Iterator[Recorder]:
    """`Traceable.trace` of a strategy of one process: its clock is the job's, so no offset is measured; the
    file is written when the block ends, however it ends."""
    check_mode(mode)
    if recorder.recording:
        raise InputError(
            f"A trace is recording already. Received: trace({str(directory)!r}) inside it. End the first trace."
        )
    recorder.clear()
    if clock is not None:
        recorder.clock = clock
    recorder.start(mode=mode)
    try:
        yield recorder
    finally:
        recorder.stop()
        recorder.write(directory)
        recorder.clear()
