"""A group of local task processes: start them, stream their output line by line, stop them.

Each process leads its own session, so stopping a task also stops whatever it started
(data-loader workers, a shell's children) instead of leaving orphans holding ports and pipes.
A guard process (``guard``) ends every task's session when the launcher dies without stopping
them (SIGKILL, the out-of-memory killer).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutputLine:
    """One line a task wrote, without its line ending."""

    task: str
    """The task that wrote it (``worker:1``)."""
    stream: str
    """``stdout`` or ``stderr``."""
    text: str


Sink = Callable[[OutputLine], None]


def describe_exit(returncode: int) -> str:
    """Say in words how a process ended; negative return codes are signals.

    Example:
        >>> describe_exit(-9)
        'killed by SIGKILL (killed, often the out-of-memory killer: check `dmesg` or the memory limit)'
    """
    if returncode == 0:
        return "exited normally (exit code 0)"
    if returncode > 0:
        text = f"exit code {returncode}"
        # A shell reports a child killed by signal N as 128 + N.
        if returncode > 128 and _signal_name(returncode - 128):
            text += f" (128 + {returncode - 128}: a shell's report of {_describe_signal(returncode - 128)})"
        return text
    return _describe_signal(-returncode)


_SIGNAL_MEANINGS = {
    "SIGKILL": "killed, often the out-of-memory killer: check `dmesg` or the memory limit",
    "SIGSEGV": "segmentation fault, a crash in native code (torch, a CUDA or C extension); "
    "the task's stderr has a Python traceback from faulthandler",
    "SIGABRT": "aborted, usually a failed check in native code; see the task's stderr",
    "SIGBUS": "bus error, often shared memory (/dev/shm) too small for data-loader workers",
    "SIGTERM": "terminated by another process (a scheduler, or a person)",
    "SIGINT": "interrupted (Ctrl-C)",
    "SIGFPE": "arithmetic fault in native code",
}


def _signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def _describe_signal(number: int) -> str:
    name = _signal_name(number)
    if name is None:
        return f"killed by unknown signal {number}"
    meaning = _SIGNAL_MEANINGS.get(name)
    return f"killed by {name} ({meaning})" if meaning else f"killed by {name}"


class _Guard:
    """The launcher's side of the guard process: tells it which process groups to end if the launcher dies."""

    def __init__(self, grace_period: float) -> None:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "guard.py")
        # Its own session: a Ctrl-C or a scheduler's SIGTERM to the launcher's group must not end the guard first.
        self._process = subprocess.Popen(
            [sys.executable, "-I", "-S", script, repr(float(grace_period))],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        assert self._process.stdin is not None  # stdin=subprocess.PIPE always gives a pipe
        self._stdin = self._process.stdin
        self._lock = threading.Lock()
        self._closed = False

    def tell(self, line: str) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                self._stdin.write(f"{line}\n".encode())
                self._stdin.flush()
            except (BrokenPipeError, ValueError):
                logger.warning("the guard of the tasks has exited; a launcher killed now would leave its tasks running")

    def close(self) -> None:
        """Ends the guard (every task it was told of has been stopped, so it ends none)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._stdin.close()
            except BrokenPipeError:
                pass
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


class TaskGroup:
    """The processes of one attempt; every exit is reported on ``exits`` as ``(task, returncode)``.

    ``grace_period``: what the guard gives the tasks between SIGTERM and SIGKILL if the launcher dies.
    """

    def __init__(
        self, argv: Sequence[str], envs: Mapping[str, Mapping[str, str]], sink: Sink, *, grace_period: float = 5.0
    ) -> None:
        self.exits: queue.Queue[tuple[str, int]] = queue.Queue()
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._argv = list(argv)
        self._envs = {task: dict(env) for task, env in envs.items()}
        self._sink = sink
        self._sink_lock = threading.Lock()  # a sink sees whole lines, one at a time
        self._readers: list[threading.Thread] = []
        self._guard = _Guard(grace_period)
        try:
            for task in self._envs:
                self.start(task)
        except BaseException:
            self.stop(grace_period=0.0)
            raise

    def start(self, task: str) -> None:
        """Starts ``task`` (again, once its earlier process has exited and been stopped) with its environment."""
        process = subprocess.Popen(
            self._argv,
            env=self._envs[task],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self._guard.tell(f"+{process.pid}")
        self.processes[task] = process
        for stream, pipe in (("stdout", process.stdout), ("stderr", process.stderr)):
            self._spawn(self._read, task, stream, pipe)
        self._spawn(self._wait, task, process)

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        # Daemon threads: a grandchild that keeps a pipe open must not keep the launcher alive.
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        if target == self._read:
            self._readers.append(thread)

    def _read(self, task: str, stream: str, pipe: IO[bytes]) -> None:
        sink_failed = False
        with pipe:
            # Keep reading even if the sink fails: a task blocked on a full pipe would hang.
            for raw in iter(pipe.readline, b""):
                if sink_failed:
                    continue
                line = OutputLine(task, stream, raw.decode(errors="replace").rstrip("\r\n"))
                try:
                    with self._sink_lock:
                        self._sink(line)
                except Exception:
                    sink_failed = True
                    logger.exception(
                        "the output sink failed on a line of %s %s; dropping its further output", task, stream
                    )

    def _wait(self, task: str, process: subprocess.Popen[bytes]) -> None:
        self.exits.put((task, process.wait()))

    def running(self) -> list[str]:
        """Tasks whose process has not exited yet."""
        return [task for task, process in self.processes.items() if process.poll() is None]

    def stop(self, tasks: Sequence[str] | None = None, *, grace_period: float) -> None:
        """SIGTERM ``tasks`` (default: all), then SIGKILL what is left after ``grace_period`` seconds."""
        chosen = [self.processes[t] for t in (self.processes if tasks is None else tasks)]
        for process in chosen:
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + grace_period
        for process in chosen:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for process in chosen:
            # Also reaches the children of a task that has already exited.
            _signal_group(process, signal.SIGKILL)
        for process in chosen:
            process.wait()
            self._guard.tell(f"-{process.pid}")
        if tasks is None:
            self._guard.close()

    def drain_output(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until every line the tasks wrote has reached the sink."""
        deadline = time.monotonic() + timeout
        for reader in self._readers:
            reader.join(max(0.0, deadline - time.monotonic()))


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone
