"""A watchdog for collectives that run on the GPU, so the host never waits for one (NCCL).

Under NCCL, `CrossWorker.wait` does not block the host: each work handle's `wait()` only orders the
current CUDA stream after the collective, and the handles come here. One daemon thread per
`CrossWorker`, started with the first handles, polls them in the order they were handed over (a
stream finishes its collectives in order), sleeps on a condition while nothing is pending, and keeps
the promises the host path keeps by waiting itself: the stall warning at `stall_warning_after`, and at
the timeout the roll call whose error names who is missing. That error is recorded, logged, and the
process group is aborted, which ends the collective's kernel, so a host blocked in a CUDA sync (a
`.tolist()` of the result) is released. The training thread raises the recorded error at its next
collective call, or at `check()`, which every host read of a collective's result is followed by: a
value read from an aborted collective is never used.

    >>> dog = Watchdog(timeout=60.0, stall_warning_after=15.0, on_stall=warn, on_failure=roll_call)  # doctest: +SKIP
    >>> dog.watch(works, what="gradient all-reduce", step=3)                                          # doctest: +SKIP
    >>> dog.check()   # raises the recorded CollectiveTimeoutError / ReplicaError, if any            # doctest: +SKIP
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)

# The poll only has to notice a stall or the deadline (seconds), not to release anyone: a pause that grows
# from half a millisecond to 10 ms keeps the thread's wake-ups, each a turn at the GIL that the training
# thread queues kernels with, to at most 100 a second while a collective runs.
_POLL_FIRST_S = 0.5e-3
_POLL_MAX_S = 10e-3

OnStall = Callable[[str, int, float], None]
"""(what, step, start): logs the stall warning of a collective waited for since `start` (time.monotonic)."""
OnFailure = Callable[[str, int, "Exception | None"], Exception]
"""(what, step, error or None for a timeout): holds the roll call, returns the error that names who is missing."""


def abort_process_group() -> None:
    """Aborts this process's process groups, NCCL communicators included, so that kernels waiting on them end.

    `torch.distributed.distributed_c10d._abort_process_group` (torch 2.13) is experimental and documented for
    NCCL only, hence the guards: without it, or without a process group, there is nothing to abort here
    and torch's own NCCL watchdog (at the process group's longer timeout) ends the collective instead.
    """
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None or not dist.is_available() or not dist.is_initialized():
        logger.warning(
            "The process group cannot be aborted (no torch.distributed._abort_process_group, or no "
            "process group); torch's own NCCL watchdog ends the stuck collective at its timeout."
        )
        return
    abort()


@dataclass
class _Batch:
    """The handles of one `watch` call: one collective's name, step and start, one stall warning."""

    what: str
    step: int
    start: float
    warned: bool = False


class Watchdog:
    """Watches device collectives the host did not wait for; records the first failure for the host to raise.

    Args:
        timeout: seconds a collective may take, counted from `watch`, before the roll call.
        stall_warning_after: seconds before the stall warning (`on_stall`).
        on_stall: logs the stall warning (CrossWorker._warn_stall).
        on_failure: the roll call; returns the error naming who is missing (CrossWorker._failure).
        abort: called once, after a failure, to release a host blocked on the collective
            (default: `abort_process_group`).
    """

    def __init__(
        self,
        *,
        timeout: float,
        stall_warning_after: float,
        on_stall: OnStall,
        on_failure: OnFailure,
        abort: Callable[[], None] | None = None,
    ) -> None:
        self.timeout = timeout
        self.stall_warning_after = stall_warning_after
        self._on_stall = on_stall
        self._on_failure = on_failure
        self._abort = abort if abort is not None else abort_process_group
        self._pending: collections.deque[tuple[Any, _Batch]] = collections.deque()
        self._changed = threading.Condition()
        self._error: Exception | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        """The running thread's own stop signal: a thread that close() gave up waiting for never takes new handles."""

    def watch(self, works: Sequence[Any], *, what: str, step: int) -> None:
        """Hands over work handles (their `wait()` already called) whose collective is `what` of `step`."""
        self.check()
        if not works:
            return
        batch = _Batch(what, step, time.monotonic())
        with self._changed:
            self._pending.extend((work, batch) for work in works)
            if self._thread is None:
                self._stop = threading.Event()
                self._thread = threading.Thread(
                    target=self._run, args=(self._stop,), daemon=True, name="stratagem-collective-watchdog"
                )
                self._thread.start()
            self._changed.notify_all()

    def check(self) -> None:
        """Raises the recorded failure (CollectiveTimeoutError or ReplicaError naming who is missing), if any."""
        error = self._error
        if error is not None:
            raise error

    @property
    def pending(self) -> int:
        """How many handed-over handles have not been seen complete yet."""
        with self._changed:
            return len(self._pending)

    def is_alive(self) -> bool:
        """Whether the watchdog's thread runs (it starts with the first handles and ends at `close` or a failure)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def close(self, seconds: float = 1.0) -> None:
        """Stops the thread and lets go of the pending handles (waiting for the thread at most `seconds`: one
        inside a roll call ends with the process). A later `watch` starts another thread."""
        with self._changed:
            self._stop.set()
            self._pending.clear()
            self._changed.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=seconds)

    # ---- the thread ---------------------------------------------------------------------------------
    def _run(self, stop: threading.Event) -> None:
        pause = _POLL_FIRST_S
        while True:
            with self._changed:
                while not self._pending and not stop.is_set():
                    self._changed.wait()  # idle: no wake-up until handles come or close() is called
                if stop.is_set():
                    return
                work, batch = self._pending[0]
            try:
                done = bool(work.is_completed())
            except Exception as error:  # noqa: BLE001 - a handle that cannot even say so has failed
                self._fail(batch, error)
                return
            if done:
                with self._changed:
                    if self._pending and self._pending[0][0] is work:
                        self._pending.popleft()
                pause = _POLL_FIRST_S
                continue
            now = time.monotonic()
            if now >= batch.start + self.timeout:
                self._fail(batch, None)
                return
            if not batch.warned and now >= batch.start + min(self.stall_warning_after, self.timeout):
                batch.warned = True
                try:
                    self._on_stall(batch.what, batch.step, batch.start)
                except Exception as error:  # noqa: BLE001 - a warning that fails must not end the watch
                    logger.warning("The stall warning for the %s of step %d failed: %s", batch.what, batch.step, error)
                continue
            with self._changed:
                if not stop.is_set():
                    self._changed.wait(min(pause, max(0.0, batch.start + self.timeout - now)))
            pause = min(2 * pause, _POLL_MAX_S)

    def _fail(self, batch: _Batch, cause: Exception | None) -> None:
        """Records the error the roll call names, logs it, and aborts the process group (once)."""
        try:
            error = self._on_failure(batch.what, batch.step, cause)
        except Exception as roll_call_error:  # noqa: BLE001 - the host must get an error whatever the roll call did
            error = roll_call_error
        if cause is not None and error.__cause__ is None:
            error.__cause__ = cause
        logger.error("%s", error)  # logged before the host can raise it, so the log always explains the error
        with self._changed:
            self._error = error
            self._pending.clear()
        try:
            self._abort()
        except Exception as abort_error:  # noqa: BLE001 - the error above is what the host raises
            logger.error("Aborting the process group after that failure failed too: %s", abort_error)
