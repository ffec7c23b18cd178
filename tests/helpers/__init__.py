"""Multi-process test helpers: free loopback ports and ranks run in spawned processes with a timeout."""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKERS = Path(__file__).resolve().parent.parent / "workers"
"""tests/workers/: the scripts that launch_workers runs."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOPs ``pid`` and returns once every one of its threads is stopped (Linux: /proc). ``kill`` only makes
    the signal pending: a thread woken meanwhile (by a request it serves) can still run, and answer, first."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue  # a thread that has just exited
        if states and all(state in ("T", "t") for state in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop within {timeout:g} s: thread states {states}")
        time.sleep(0.001)


def _launch(script: str, settings: dict[str, str], timeout: float, workers: int = 2) -> tuple[int, list[Any]]:
    """Runs tests/workers/`script` as `workers` workers under `stratagem launch`; the exit code and every output
    line."""
    from stratagem import environ
    from stratagem.cluster import launch

    env = dict(environ.current())
    env.update(settings)
    lines: list[Any] = []
    result = launch(
        [sys.executable, str(WORKERS / script)],
        workers=workers,
        env=env,
        sink=lines.append,
        timeout=timeout,
        grace_period=2,
    )
    return result.exit_code, lines


def launch_workers(
    script: str, settings: dict[str, str], *, timeout: float, tail: int = 40, workers: int = 2
) -> tuple[int, str]:
    """Runs tests/workers/`script` as `workers` workers under `stratagem launch` (loopback, free ports), with the
    test's settings added to the environment; returns the job's exit code and its last `tail` lines of output, each
    prefixed with its task, for the test's assertion message."""
    exit_code, lines = _launch(script, settings, timeout, workers)
    return exit_code, "\n".join(f"[{line.task}] {line.text}" for line in lines[-tail:])


def launch_json_workers(
    script: str, settings: dict[str, Any], *, timeout: float, workers: int = 2
) -> tuple[int, dict[int, dict], list[str]]:
    """As `launch_workers`; each worker prints one JSON object with its "rank": returns the exit code, those
    objects by rank, and every line of output."""
    exit_code, lines = _launch(script, {k: str(v) for k, v in settings.items()}, timeout, workers)
    texts = [line.text for line in lines]
    outcomes = {}
    for text in texts:
        if text.startswith("{"):
            outcome = json.loads(text)
            outcomes[outcome["rank"]] = outcome
    return exit_code, outcomes, texts


@dataclass(frozen=True)
class RankOutcome:
    """What one rank's function returned, or the exception it raised (type name and message)."""

    rank: int
    value: Any = None
    error_type: str | None = None
    error: str | None = None


def _entry(fn: Callable[..., Any], rank: int, args: tuple[Any, ...], results: Any) -> None:
    try:
        results.put(RankOutcome(rank, value=fn(rank, *args)))
    except BaseException as exc:  # report every failure to the parent instead of dying silently
        results.put(RankOutcome(rank, error_type=type(exc).__name__, error=f"{exc}\n{traceback.format_exc()}"))


def run_ranks(
    fn: Callable[..., Any], ranks: Sequence[int], *, args: tuple[Any, ...] = (), timeout: float
) -> dict[int, RankOutcome]:
    """Run ``fn(rank, *args)`` for each rank in its own spawned process; fail if any is not done in ``timeout`` s.

    ``fn`` must be importable (defined at module level). Ranks left running at the deadline are
    killed and named in the AssertionError, so a hang fails the test instead of stalling it.
    """
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = {rank: context.Process(target=_entry, args=(fn, rank, args, results), daemon=True) for rank in ranks}
    for process in processes.values():
        process.start()
    outcomes: dict[int, RankOutcome] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < len(processes):
            try:
                outcome = results.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(processes) - set(outcomes))
                raise AssertionError(f"ranks {missing} did not finish within {timeout} s") from None
            outcomes[outcome.rank] = outcome
    finally:
        for process in processes.values():
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
    return outcomes
