"""The coordinator's heartbeat: how a worker that stops answering (stopped, cut off, wedged) is found.

A dead worker is found by its calls: its port refuses them (``UNAVAILABLE``). A worker whose process is
stopped (SIGSTOP), whose host is cut off the network, or whose serving threads are stuck still holds its
connection open, so a call to it gets no answer and no error. One thread per worker pings it on a channel
of its own every ``interval`` seconds; when no ping has been answered for ``timeout`` seconds the worker
counts as hung: the calls in flight to it are cut (``Cancellation``), which the coordinator
treats as the worker's loss (its function goes back to the queue). Pings go on while it is lost, so a
worker that answers again (SIGCONT, the network back) is seen at its next ping. When a call to the worker
runs out of time first (``closure_timeout``), ``verdict`` says which it was: the worker answers a ping
(the function is slow or stuck) or stays silent until it counts as hung (the worker is lost); an answer
from before the call ran out proves nothing about the worker now.

    >>> beat = Heartbeat(client, interval=2.0, timeout=10.0)   # doctest: +SKIP
    >>> beat.start(); ...; beat.stop()                          # doctest: +SKIP
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from stratagem.diagnose import PlacementDecision
from stratagem.errors import CollectiveTimeoutError, ParameterServerError
from stratagem.strategies.parameter_server.transport import Client

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 2.0
"""Seconds between two pings of a worker. A ping costs the worker a few microseconds of one serving thread."""
HEARTBEAT_TIMEOUT = 10.0
"""Seconds without an answer after which a worker counts as hung: five missed pings, so a worker busy in
a long step, a loaded machine or a slow network (a ping answers in about a millisecond on one host) is not
called hung, while a job with a hung worker goes on within seconds."""
WORKER_RECOVERY_TIMEOUT = 60.0
"""Default seconds a lost worker's thread waits for it to answer again: time for a launcher to restart a
dead worker (a new process imports torch in seconds) or for an operator to continue a stopped one."""
CLOSURE_TIMEOUT = 300.0
"""Default seconds one scheduled function may run on a worker that still answers its heartbeat: five minutes,
for a step that loads data or builds its iterator on its first run. It is not what finds a hung worker (the
heartbeat does, within ``HEARTBEAT_TIMEOUT``); it ends a function that is itself stuck."""

DEFAULTS = {
    "heartbeat_interval": HEARTBEAT_INTERVAL,
    "heartbeat_timeout": HEARTBEAT_TIMEOUT,
    "worker_recovery_timeout": WORKER_RECOVERY_TIMEOUT,
    "closure_timeout": CLOSURE_TIMEOUT,
}
"""The ``ClusterCoordinator``'s waits by argument name, as ``ParameterServerStrategy.explain()`` states them."""


class Cancellation:
    """Lets another thread cut a call in flight (the coordinator's heartbeat, when the worker running it stopped
    answering): ``cancel`` ends the call at once with ``CANCELLED``, which ``transport.task_lost`` counts as the task's loss.
    A call started after ``cancel`` and before ``reset`` is cut as soon as it starts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[Any] = []
        self.cancelled = False

    def track(self, call: Any) -> None:
        """Follows ``call`` (a gRPC call object) until ``forget``; cuts it at once when already cancelled."""
        with self._lock:
            self._calls.append(call)
            cancelled = self.cancelled
        if cancelled:
            call.cancel()

    def forget(self, call: Any) -> None:
        with self._lock:
            if call in self._calls:
                self._calls.remove(call)

    def cancel(self) -> None:
        """Cuts every call followed now, and every one started until ``reset``."""
        with self._lock:
            self.cancelled = True
            calls = list(self._calls)
        for call in calls:
            call.cancel()

    def reset(self) -> None:
        with self._lock:
            self.cancelled = False


@dataclass(frozen=True)
class WorkerFault:
    """A worker the coordinator lost: ``kind`` is ``"hung"`` (no heartbeat answer for ``silent_s`` seconds) or
    ``"unreachable"`` (a call failed: it died or its port is closed); ``at`` is ``time.monotonic()``."""

    task: str
    kind: str
    silent_s: float
    at: float


class Heartbeat:
    """Pings one worker through ``client`` (a channel of its own) every ``interval`` s on a thread of its own."""

    def __init__(self, client: Client, *, interval: float, timeout: float) -> None:
        self.client = client
        self.task = client.task
        self.interval = interval
        self.timeout = timeout
        self.cancellation = Cancellation()
        self._cv = threading.Condition()
        self._last_answer = time.monotonic()  # the grace of a worker that has not started yet
        self._answered = 0  # pings answered so far
        self._hung_since: float | None = None
        self._hangs = 0  # times found hung so far
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{self.task}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self.cancellation.cancel()  # nothing waits on a worker once the coordinator is shut down

    @property
    def hung(self) -> bool:
        """True from the moment the worker has not answered for ``timeout`` s until it answers again."""
        return self._hung_since is not None

    def silent_for(self) -> float:
        """Seconds since the worker last answered a ping (or since the heartbeat started)."""
        return time.monotonic() - self._last_answer

    def answers(self) -> int:
        """How many pings the worker has answered so far (compare two readings to see a fresh answer)."""
        return self._answered

    def wait_answer(self, after: int, timeout: float) -> bool:
        """True as soon as the worker has answered more than ``after`` pings, False after ``timeout`` s or once
        the heartbeat is stopped."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._answered <= after and not self._stopped:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cv.wait(remaining)
            return self._answered > after

    def verdict(self) -> bool:
        """Whether the worker still answers, asked when a call to it ran out of time: True at its next answer to a
        ping, False as soon as it counts as hung (already, or once ``timeout`` s of silence have passed, as a
        worker stopped mid-call does), or when neither came within ``timeout + 2 * interval`` s (by then it has
        been silent too long to count as answering) or the heartbeat is stopped."""
        # The heartbeat finds a silent worker hung within ``timeout`` of silence plus one ping's interval; the
        # second interval is room for a loaded machine.
        deadline = time.monotonic() + self.timeout + 2 * self.interval
        with self._cv:
            answered, hangs = self._answered, self._hangs
            while True:
                if self._hung_since is not None or self._hangs > hangs:
                    return False
                if self._answered > answered:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stopped:
                    return False
                self._cv.wait(remaining)

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    if self._stopped:
                        return
                started = time.monotonic()
                # A ping ends no later than the moment the worker would count as hung, so that moment is kept to.
                deadline = self._last_answer + self.timeout - started
                wait = self.interval if self.hung else max(0.05, min(self.timeout, deadline))
                try:
                    self.client.call("Ping", "ping", timeout=wait, small_reply=True)
                except CollectiveTimeoutError:
                    self._missed("its ping got no answer")
                except ParameterServerError:
                    self._missed("its port refuses calls" if self._answered else "it has not answered yet")
                else:
                    self._answer()
                with self._cv:
                    self._cv.wait_for(lambda: self._stopped, max(0.0, self.interval - (time.monotonic() - started)))
        finally:
            self.client.close()

    def _answer(self) -> None:
        with self._cv:
            self._last_answer = time.monotonic()
            self._answered += 1
            was_hung, self._hung_since = self._hung_since, None
            self.cancellation.reset()
            self._cv.notify_all()
        if was_hung is not None:
            logger.warning("%s answers its heartbeat again after %.1f s", self.task, time.monotonic() - was_hung)

    def _missed(self, why: str) -> None:
        silent = self.silent_for()
        if self.hung or silent < self.timeout:
            return
        with self._cv:
            self._hung_since = time.monotonic()
            self._hangs += 1
            self._cv.notify_all()  # a verdict() waits for this
        logger.warning(
            "%s hung: no answer to its heartbeat for %.1f s (heartbeat_timeout=%g s; %s); its calls in flight are cut",
            self.task,
            silent,
            self.timeout,
            why,
        )
        self.cancellation.cancel()


def lost_workers_decision(given: dict[str, float] | None) -> PlacementDecision:
    """How the coordinator finds a worker lost (the heartbeat) and how long it waits, as an ``explain()`` line;
    `given`: the coordinator's timeouts, None before one exists (the defaults then)."""
    t = given or DEFAULTS
    return PlacementDecision(
        subject="lost workers",
        choice=f"hung after {t['heartbeat_timeout']:g} s without a heartbeat answer",
        reason=(
            f"the coordinator pings each worker every {t['heartbeat_interval']:g} s; a worker that died or "
            f"stopped answering for heartbeat_timeout={t['heartbeat_timeout']:g} s has its function in flight "
            f"cut and run again on another worker, and is taken back if it answers within "
            f"worker_recovery_timeout={t['worker_recovery_timeout']:g} s; one function may run up to "
            f"closure_timeout={t['closure_timeout']:g} s on a worker that answers"
            + ("" if given else " (the ClusterCoordinator's defaults: none is made yet)")
        ),
    )
