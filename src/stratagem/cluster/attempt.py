"""One attempt of a local launch: wait for the workers, recover a parameter-server job's lost worker, and stop
when asked to from outside (a signal to the launcher).

`launch` (cluster/launch.py) starts a `TaskGroup` per attempt and calls `run_attempt`, which returns how the
attempt ended (`None` when every worker finished) without stopping the tasks itself: `launch` stops them on
every way out.
"""

from __future__ import annotations

import logging
import queue
import signal
import time
from dataclasses import dataclass

from stratagem.cluster.processes import OutputLine, Sink, TaskGroup, describe_exit

logger = logging.getLogger(__name__)

LAUNCH_TASK = "launch"
"""The task name of the launcher's own lines on the sink."""

POLL_SECONDS = 0.1
"""How often the wait for the tasks' exits wakes to look for a stop request (see `StopRequest`)."""


@dataclass(frozen=True, kw_only=True)
class TaskFailure:
    """How one attempt ended badly."""

    attempt: int
    """0 for the first start, 1 after the first restart..."""
    task: str | None
    """The task that failed first; ``None`` when the run timed out or the launcher was told to stop."""
    returncode: int | None
    """Its return code (negative: killed by that signal); ``None`` on timeout; minus the signal's number when
    a signal told the launcher to stop."""
    reason: str
    """In words: ``exit code 3``, ``killed by SIGKILL (...)``, ``timed out after 30 s ...``."""


@dataclass(frozen=True, kw_only=True)
class Recovery:
    """A worker of a parameter-server job that died without stopping the job."""

    attempt: int
    task: str
    returncode: int
    reason: str
    """How it ended, in words (``killed by SIGKILL (...)``)."""
    action: str
    """``restarted`` (started again alone, at its address) or ``left out`` (the job went on without it)."""

    def explain(self) -> str:
        if self.action == "restarted":
            return f"{self.task} {self.reason}; restarted it alone, at its address, while the job went on"
        return (
            f"{self.task} {self.reason}; the job goes on without it (no restarts left, see max_restarts; "
            "the coordinator runs its steps on the other workers)"
        )


class StopRequest:
    """A request to stop a launch, made from outside its loop: pass it to `launch(stop=...)` and install it as
    the handler of the signals that should stop the launch.

    Example:
        >>> stop = StopRequest()
        >>> previous = signal.signal(signal.SIGTERM, stop.request)   # doctest: +SKIP
        >>> result = launch(argv, workers=2, env=env, sink=sink, stop=stop)  # doctest: +SKIP
        >>> stop.signum                                               # doctest: +SKIP
        15

    The handler only stores the signal's number. A handler that raised instead (SystemExit) would do so at
    whatever line the launcher was on: inside ``subprocess.Popen`` after the fork, so that a task is started and
    never stopped, or in the middle of stopping the tasks. The launch's wait wakes every `POLL_SECONDS` to
    look: Python runs a signal's handler only in the main thread, and when the kernel hands the signal to
    another thread (it does whenever the main thread blocks signals at that instant: glibc blocks them while
    it creates a thread, CPython while it forks), the main thread, asleep in a lock's wait, is not woken for it.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        """The first signal that asked for the stop; None while none has."""

    def request(self, signum: int, frame: object = None) -> None:
        """Asks for the stop (a signal handler's signature); a later request keeps the first signal."""
        if self.signum is None:
            self.signum = signum

    def failure(self, attempt: int) -> TaskFailure | None:
        """The attempt's end when the stop has been asked for, else None."""
        if self.signum is None:
            return None
        name = signal.Signals(self.signum).name
        return TaskFailure(attempt=attempt, task=None, returncode=-self.signum, reason=f"received {name}")


def run_attempt(
    group: TaskGroup,
    *,
    workers: int,
    deadline: float | None,
    timeout: float | None,
    attempt: int,
    ps: int = 0,
    worker_restarts: int = 0,
    grace_period: float = 0.0,
    sink: Sink | None = None,
    recoveries: list[Recovery] | None = None,
    stop: StopRequest | None = None,
) -> TaskFailure | None:
    """Wait for the workers to finish; the first failure, the deadline or a stop request ends the attempt. With
    parameter servers, a worker other than the chief that dies is restarted alone or left out instead
    (``recoveries``)."""
    pending = {f"worker:{i}" for i in range(workers)}
    restarted: dict[str, int] = {}
    while pending:
        stopped = None if stop is None else stop.failure(attempt)
        if stopped is not None:
            return stopped
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            task, returncode = group.exits.get(
                timeout=POLL_SECONDS if remaining is None else min(remaining, POLL_SECONDS)
            )
        except queue.Empty:
            if remaining is None or remaining > POLL_SECONDS:
                continue
            running = ", ".join(group.running())
            return TaskFailure(
                attempt=attempt,
                task=None,
                returncode=None,
                reason=f"timed out after {timeout:g} s; still running: {running}",
            )
        if task.startswith("ps:"):
            # A parameter server serves until the workers finish; leaving early strands them.
            reason = describe_exit(returncode)
            if returncode == 0:
                reason += ", but a parameter server must serve until the workers finish"
            return TaskFailure(attempt=attempt, task=task, returncode=returncode, reason=reason)
        if ps and task == "worker:0" and returncode == 0:
            # The chief is the job: it has ended it (told every task to exit). A worker restarted late may not
            # have heard; it gets the grace period to exit by itself, then is stopped with the servers.
            _let_finish(group, pending - {task}, grace_period)
            return None
        if returncode != 0 and ps and task != "worker:0" and "worker:0" in pending:
            recovery = _recover(group, task, returncode, attempt, restarted, worker_restarts)
            if recoveries is not None:
                recoveries.append(recovery)
            logger.info("%s", recovery.explain())  # the sink says it to the user
            if sink is not None:
                sink(OutputLine(LAUNCH_TASK, "stderr", recovery.explain()))
            if recovery.action == "left out":
                pending.discard(task)
            continue
        if returncode != 0:
            return TaskFailure(attempt=attempt, task=task, returncode=returncode, reason=describe_exit(returncode))
        pending.discard(task)
    return None


def _let_finish(group: TaskGroup, workers: set[str], seconds: float) -> None:
    """Waits at most ``seconds`` for ``workers`` to exit (how they exit no longer matters: the job is done)."""
    deadline = time.monotonic() + seconds
    while workers and time.monotonic() < deadline:
        try:
            task, _ = group.exits.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return
        workers.discard(task)


def _recover(
    group: TaskGroup, task: str, returncode: int, attempt: int, restarted: dict[str, int], worker_restarts: int
) -> Recovery:
    """A worker of a parameter-server job died while the chief runs: start it again alone, or leave it out."""
    reason = describe_exit(returncode)
    group.stop([task], grace_period=0.0)  # whatever it started in its session goes with it
    if restarted.get(task, 0) < worker_restarts:
        restarted[task] = restarted.get(task, 0) + 1
        group.start(task)
        return Recovery(attempt=attempt, task=task, returncode=returncode, reason=reason, action="restarted")
    return Recovery(attempt=attempt, task=task, returncode=returncode, reason=reason, action="left out")
