"""Stopping on SIGTERM or Ctrl-C at a step boundary every worker agrees on, with a backup, within a grace period.

Kubernetes and SLURM preempt with SIGTERM, then SIGKILL after a grace period. While a
`BackupAndRestore` is active, `StopSignals` catches SIGTERM and SIGINT in the main thread and only
records them; `fit` folds the record into the metric state every step already sums over every
replica and worker (one more float64 in that reduction, `fold_stop_flag`), so every worker reads
the same sum after the same step and stops there together, with no collective of its own. The
chief then writes a backup and `fit` raises `stratagem.Preempted`, a ``SystemExit`` with code
128 + the signal's number (143 for SIGTERM, 130 for SIGINT): a script that does not catch it exits
with that code, and a rerun resumes from the step it stopped after.

A watchdog started at the first signal ends the process with the same code when the stop has not
finished within `grace_period` seconds (a step stuck on a lost worker, a slow disk); the backup
being written then is abandoned as a temporary file, and the backups before it stay whole (see
`stratagem.train.checkpoint.save_checkpoint`). A second signal ends the process at once, through
the handler that was installed before.

Example:
    >>> signals = StopSignals(grace_period=25.0)
    >>> signals.install()        # main thread only; returns False (and changes nothing) elsewhere
    >>> step = fold_stop_flag(train_step, signals)
    >>> signals.uninstall()
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code(signum: int) -> int:
    """The code a process stopped by `signum` exits with: 128 + its number, as a shell reports a signal."""
    return 128 + signum


class StopSignals:
    """SIGTERM/SIGINT handlers that ask for a stop at the next step boundary, and the grace period's watchdog."""

    def __init__(self, grace_period: float) -> None:
        self.grace_period = grace_period
        self.requested = 0
        """The number of the first signal received (0: none)."""
        self.received_at: float | None = None
        """``time.monotonic()`` when it came."""
        self._previous: dict[int, Any] = {}
        self._watchdog: threading.Timer | None = None
        self._acted_on = False

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> bool:
        """Installs the handlers; False (nothing changed) outside the main thread, where Python allows none.
        A signal this process ignores (SIG_IGN) is left ignored."""
        if self._previous:
            return True
        if threading.current_thread() is not threading.main_thread():
            logger.info("fit runs outside the main thread: SIGTERM and SIGINT keep their handlers (no stop on signal).")
            return False
        self.requested, self.received_at, self._acted_on = 0, None, False
        for signum in SIGNALS:
            if signal.getsignal(signum) == signal.SIG_IGN:
                continue  # ignored on purpose (nohup, a background job of a shell): it stays ignored
            previous = signal.signal(signum, self._handle)
            earlier = getattr(previous, "__self__", None)
            if isinstance(earlier, StopSignals) and earlier is not self:
                # A fit that never ended (a callback skipped the clean-up): its handler is not one to go back to.
                previous = earlier._previous.pop(signum, signal.SIG_DFL)
            self._previous[signum] = previous
        return True

    def uninstall(self) -> None:
        """Puts the previous handlers back; a signal that came too late to be acted on is delivered to them."""
        if not self._previous:
            return
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if self.requested and not self._acted_on:
            # Training ended (or failed) before a step boundary saw the signal: it is not swallowed.
            signal.raise_signal(self.requested)

    def acted_on(self) -> None:
        """Marks the signal as handled: `uninstall` does not deliver it again."""
        self._acted_on = True

    def seconds_since_signal(self) -> float:
        return 0.0 if self.received_at is None else time.monotonic() - self.received_at

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            # A second signal: the user (or the scheduler) insists. Stop now, as the previous handler would.
            logger.warning(
                "A second %s: stopping at once, without waiting for the backup.", signal.Signals(signum).name
            )
            handler = self._previous.get(signum, signal.SIG_DFL)
            signal.signal(signum, handler)
            signal.raise_signal(signum)
            return
        self.requested, self.received_at = signum, time.monotonic()
        logger.warning(
            "Received %s: stopping after the current step, writing a backup, exiting with code %d "
            "(within the grace period of %g s).",
            signal.Signals(signum).name,
            exit_code(signum),
            self.grace_period,
        )
        self._watchdog = threading.Timer(self.grace_period, self._expire, args=(signum,))
        self._watchdog.daemon = True
        self._watchdog.start()

    def _expire(self, signum: int) -> None:
        logger.error(
            "The grace period of %g s after %s ran out before the stop finished (a step waiting on a lost worker, or "
            "a slow save): exiting now with code %d; the backups written before are whole.",
            self.grace_period,
            signal.Signals(signum).name,
            exit_code(signum),
        )
        logging.shutdown()
        os._exit(exit_code(signum))  # noqa: SLF001 - no cleanup may wait on the stuck step


def fold_stop_flag(step_fn: Callable[..., torch.Tensor], signals: StopSignals) -> Callable[..., torch.Tensor]:
    """`step_fn` with one more element on its metric state: 1 when this process received a stop signal, else 0.

    The state is summed over every replica and worker; a sum above 0 (`stop_requested`) means some process was
    signalled, and every worker reads that same sum after the same step."""

    def step_with_stop_flag(*args: Any) -> torch.Tensor:
        state = step_fn(*args)
        return torch.cat([state, state.new_full((1,), 1.0 if signals.requested else 0.0)])

    return step_with_stop_flag


def split_stop_flag(state: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The metric state without the folded flag, and whether any process asked to stop (reads the device)."""
    return state[:-1], bool(state[-1] > 0)
