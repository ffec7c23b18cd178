"""The local launcher behind ``stratagem launch``: one process per task on this machine.

Tasks: ``worker:0`` .. ``worker:N-1`` (worker 0 is the chief, so TF_CONFIG has no ``chief``
entry) and, with ``ps > 0``, ``ps:0`` .. ``ps:P-1``. Each gets, on 127.0.0.1 with free ports:

- ``TF_CONFIG`` naming every task and this one;
- torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT`` (workers only: parameter servers have no rank); ``MASTER_PORT`` is worker 0's port;
- ``STRATAGEM_CLUSTER_TOKEN`` (one random token per launch), ``STRATAGEM_RESTART_COUNT``
  (0, then 1, 2... after restarts) and, when given, ``STRATAGEM_DEVICES_PER_WORKER`` and
  ``STRATAGEM_STRATEGY`` (read by `sg.strategy_from_env()`);
- unless told otherwise (``keep_freed_memory=False``), ``GLIBC_TUNABLES`` with glibc's malloc
  thresholds raised, so a training step reuses the memory the last one freed instead of faulting it
  in again (see ``stratagem.cluster.allocator``); a threshold the user set is kept.

The run succeeds when every worker exits with 0; parameter servers serve until then and are
stopped afterwards. The first task to fail (or a parameter server that exits early) stops the
others: SIGTERM, then SIGKILL after ``grace_period``. With ``max_restarts`` the whole group is
started again, as torchrun does, on fresh ports.

With parameter servers (``ps > 0``) a worker other than the chief is not the job: the chief's
coordinator runs the steps of a lost worker on the others and takes the worker back when it
returns at its address. So a worker that dies there does not stop the job: it is started again
alone, with its environment and port (at most ``max_restarts`` times per worker), or, when its
restarts are used up (none by default), the job goes on without it. Either way the sink gets a
``launch`` line saying which, and ``LaunchResult.recoveries`` lists them. The chief or a
parameter server that fails still stops the job; the chief that exits with 0 ends it (the other
tasks get the grace period to exit by themselves, then are stopped).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stratagem.cluster import allocator
from stratagem.cluster.attempt import Recovery, StopRequest, TaskFailure, run_attempt
from stratagem.cluster.processes import Sink, TaskGroup
from stratagem.errors import ClusterError
from stratagem.timeouts import check_optional_seconds, check_seconds

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
TIMEOUT_EXIT_CODE = 124  # as coreutils' timeout
OUTPUT_DRAIN_SECONDS = 2.0
# Variables a parent launcher may have set that would contradict the ones we give each task.
_INHERITED_CLUSTER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TF_CONFIG",
    "STRATAGEM_DEVICES_PER_WORKER",
)


@dataclass(frozen=True, kw_only=True)
class LaunchResult:
    """What ``launch`` did: success or the first failure, and the restarts it used."""

    exit_code: int
    """0 on success; the failed task's exit code; 128 + signal when killed; 124 on timeout."""
    failed_task: str | None
    """The task whose failure ended the run (``worker:1``), or ``None``."""
    reason: str | None
    """Why it failed, in words; ``None`` on success."""
    restarts: int
    """How many times the whole group was restarted."""
    failures: tuple[TaskFailure, ...] = ()
    """The first failure of every attempt that failed, restarted ones included."""
    recoveries: tuple[Recovery, ...] = ()
    """Workers of a parameter-server job that died while the job went on (restarted alone, or left out)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def explain(self) -> str:
        """One line per failed attempt and per worker lost without stopping the job, then the outcome."""
        # An attempt that was restarted is worded as what happened next, so that the summary of a run that
        # succeeded does not read like a failure; only the attempt that ended the run is a failure.
        final = () if self.ok else self.failures[-1:]
        lines = [
            f"attempt {f.attempt} restarted after {f.task or 'launch'} {f.reason}"
            for f in self.failures[: len(self.failures) - len(final)]
        ]
        lines += [f"attempt {f.attempt}: {f.task or 'launch'} {f.reason}" for f in final]
        lines += [f"attempt {r.attempt}: {r.explain()}" for r in self.recoveries]
        restarts = f" after {self.restarts} restart(s)" if self.restarts else ""
        if self.ok:
            lines.append(
                f"the chief ended the job normally{restarts}"
                if self.recoveries
                else f"all workers exited normally{restarts}"
            )
        else:
            lines.append(f"failed{restarts}: {self.failed_task or 'launch'} {self.reason}; exit code {self.exit_code}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "failed_task": self.failed_task,
            "reason": self.reason,
            "restarts": self.restarts,
            "failures": [f.__dict__ for f in self.failures],
            "recoveries": [r.__dict__ for r in self.recoveries],
        }


def free_ports(count: int, host: str = HOST) -> list[int]:
    """``count`` distinct ports that were free a moment ago on ``host``.

    All sockets stay bound until every port is chosen, so the ports are distinct; another
    program could still take one before a task binds it, which the task then reports.
    """
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def task_environments(
    base_env: Mapping[str, str],
    *,
    workers: int,
    ps: int = 0,
    ports: Sequence[int],
    token: str,
    restart_count: int = 0,
    devices_per_worker: int | None = None,
    keep_freed_memory: bool = True,
    strategy: str | None = None,
) -> dict[str, dict[str, str]]:
    """The full environment of every task of a local cluster, by task name.

    Example:
        >>> envs = task_environments({}, workers=2, ports=[5000, 5001], token="t")
        >>> envs["worker:1"]["RANK"], envs["worker:1"]["MASTER_PORT"]
        ('1', '5000')
    """
    if len(ports) != workers + ps:
        raise ClusterError(
            f"Need one port per task. Received: {len(ports)} ports for {workers} workers "
            f"and {ps} ps tasks. Pass {workers + ps} ports."
        )
    addresses = {"worker": [f"{HOST}:{port}" for port in ports[:workers]]}
    if ps:
        addresses["ps"] = [f"{HOST}:{port}" for port in ports[workers:]]
    common = {key: value for key, value in base_env.items() if key not in _INHERITED_CLUSTER_VARIABLES}
    common.update(
        STRATAGEM_CLUSTER_TOKEN=token,
        STRATAGEM_RESTART_COUNT=str(restart_count),
        # Children write to pipes; unbuffered output reaches the terminal as it is written,
        # and faulthandler turns a segfault into a Python traceback.
        PYTHONUNBUFFERED="1",
        PYTHONFAULTHANDLER="1",
        # Gloo binds the address the host name resolves to unless told otherwise; a local cluster stays on loopback.
        GLOO_SOCKET_IFNAME="lo",
    )
    if keep_freed_memory:
        common.update(allocator.keep_freed_memory_env(base_env))
    if devices_per_worker is not None:
        common["STRATAGEM_DEVICES_PER_WORKER"] = str(devices_per_worker)
    if strategy is not None:
        common["STRATAGEM_STRATEGY"] = strategy  # what sg.strategy_from_env() builds in each task
    envs = {}
    for kind, addrs in addresses.items():
        for index in range(len(addrs)):
            env = dict(common)
            env["TF_CONFIG"] = json.dumps({"cluster": addresses, "task": {"type": kind, "index": index}})
            if "OMP_NUM_THREADS" not in base_env:
                # The tasks share this machine's cores: each worker gets its share for intra-op threads, and a
                # parameter server (elementwise updates, bound by memory) one, so no task's OpenMP threads spin
                # against another's. A value the user set is kept.
                env["OMP_NUM_THREADS"] = "1" if kind == "ps" else str(max(1, (os.cpu_count() or 1) // workers))
            if kind == "worker":
                env.update(
                    RANK=str(index),
                    WORLD_SIZE=str(workers),
                    LOCAL_RANK=str(index),
                    LOCAL_WORLD_SIZE=str(workers),
                    MASTER_ADDR=HOST,
                    MASTER_PORT=str(ports[0]),
                )
            envs[f"{kind}:{index}"] = env
    return envs


def _validate(
    argv: Sequence[str],
    workers: int,
    ps: int,
    devices_per_worker: int | None,
    max_restarts: int,
    timeout: float | None,
    grace_period: float,
) -> None:
    checks = [
        (
            len(argv) > 0,
            "The command to launch is empty",
            f"argv={list(argv)!r}",
            "Pass the command, e.g. [sys.executable, 'train.py']",
        ),
        (workers >= 1, "At least one worker is needed", f"workers={workers}", "Pass workers >= 1"),
        (ps >= 0, "The number of parameter servers cannot be negative", f"ps={ps}", "Pass ps >= 0"),
        (
            devices_per_worker is None or devices_per_worker >= 1,
            "Each worker needs at least one device",
            f"devices_per_worker={devices_per_worker}",
            "Pass devices_per_worker >= 1, or leave it out",
        ),
        (
            max_restarts >= 0,
            "max_restarts cannot be negative",
            f"max_restarts={max_restarts}",
            "Pass max_restarts >= 0",
        ),
    ]
    check_optional_seconds("timeout", timeout, error=ClusterError)
    check_seconds("grace_period", grace_period, allow_zero=True, error=ClusterError)
    for ok, what, received, fix in checks:
        if not ok:
            raise ClusterError(f"{what}. Received: {received}. {fix}.")


def _exit_code(returncode: int) -> int:
    return returncode if returncode > 0 else 128 - returncode if returncode < 0 else 1


def launch(
    argv: Sequence[str],
    *,
    workers: int,
    env: Mapping[str, str],
    sink: Sink,
    ps: int = 0,
    devices_per_worker: int | None = None,
    max_restarts: int = 0,
    timeout: float | None = None,
    grace_period: float = 5.0,
    keep_freed_memory: bool = True,
    strategy: str | None = None,
    stop: StopRequest | None = None,
) -> LaunchResult:
    """Run ``argv`` as a local cluster of ``workers`` (and ``ps``) processes until they finish.

    ``env`` is the environment each task starts from (``stratagem.environ.current()``); every
    line a task writes goes to ``sink`` as an ``OutputLine`` as soon as it is written.
    ``timeout`` bounds the whole run, restarts included. ``keep_freed_memory=False`` leaves glibc's
    malloc thresholds at their defaults (see ``task_environments``). ``strategy`` is exported as
    ``STRATAGEM_STRATEGY``, the name `sg.strategy_from_env()` builds in each task. ``stop``: a `StopRequest`
    installed as a signal handler; once it is requested, every task is stopped (SIGTERM, then SIGKILL after
    ``grace_period``) and the result's exit code is 128 + the signal's number.

    Example:
        >>> result = launch([sys.executable, "train.py"], workers=2, env=environ.current(),
        ...                 sink=lambda line: print(f"[{line.task}] {line.text}"))  # doctest: +SKIP
        >>> result.exit_code, result.failed_task                                      # doctest: +SKIP
        (0, None)
    """
    _validate(argv, workers, ps, devices_per_worker, max_restarts, timeout, grace_period)
    token = secrets.token_hex(16)
    deadline = None if timeout is None else time.monotonic() + timeout
    failures: list[TaskFailure] = []
    recoveries: list[Recovery] = []
    for attempt in range(max_restarts + 1):
        stopped = None if stop is None else stop.failure(attempt)
        if stopped is not None:  # asked before this attempt started: nothing to start, or to stop
            failures.append(stopped)
            break
        envs = task_environments(
            env,
            workers=workers,
            ps=ps,
            ports=free_ports(workers + ps),
            token=token,
            restart_count=attempt,
            devices_per_worker=devices_per_worker,
            keep_freed_memory=keep_freed_memory,
            strategy=strategy,
        )
        logger.info("attempt %d: starting %s", attempt, ", ".join(envs))
        group = TaskGroup(argv, envs, sink, grace_period=grace_period)
        try:
            failure = run_attempt(
                group,
                workers=workers,
                deadline=deadline,
                timeout=timeout,
                attempt=attempt,
                ps=ps,
                worker_restarts=max_restarts,
                grace_period=grace_period,
                sink=sink,
                recoveries=recoveries,
                stop=stop,
            )
        finally:
            # Reached on success (stops the parameter servers), on failure, on a stop request, and on Ctrl-C.
            group.stop(grace_period=grace_period)
            group.drain_output(OUTPUT_DRAIN_SECONDS)
        if failure is None:
            return LaunchResult(
                exit_code=0,
                failed_task=None,
                reason=None,
                restarts=attempt,
                failures=tuple(failures),
                recoveries=tuple(recoveries),
            )
        failures.append(failure)
        if failure.task is None or attempt == max_restarts:
            break
        logger.warning(
            "%s %s; restarting every task (restart %d of %d)", failure.task, failure.reason, attempt + 1, max_restarts
        )
    last = failures[-1]
    exit_code = TIMEOUT_EXIT_CODE if last.returncode is None else _exit_code(last.returncode)
    return LaunchResult(
        exit_code=exit_code,
        failed_task=last.task,
        reason=last.reason,
        restarts=len(failures) - 1,
        failures=tuple(failures),
        recoveries=tuple(recoveries),
    )


def launched_by_stratagem(env: Mapping[str, str]) -> bool:
    """True inside a task started by ``stratagem launch`` (it sets ``STRATAGEM_CLUSTER_TOKEN``)."""
    return "STRATAGEM_CLUSTER_TOKEN" in env


def relaunch(
    command: Sequence[str], *, workers: int, env: Mapping[str, str], sink: Sink, **options: Any
) -> LaunchResult:
    """Run ``python -m stratagem <command>`` under the launcher with ``workers`` workers.

    For ``stratagem train --strategy multi_worker --workers 2``: the command re-runs itself once
    per worker. Call it only when ``launched_by_stratagem(env)`` is False; inside a task it raises,
    since each task would otherwise start ``workers`` more. ``options`` go to ``launch``.

    Example:
        >>> if not launched_by_stratagem(env):                                 # doctest: +SKIP
        ...     return relaunch(sys.argv[1:], workers=2, env=env, sink=printer).exit_code
    """
    if launched_by_stratagem(env):
        raise ClusterError(
            "Already running inside a task of `stratagem launch`, so relaunching would start "
            f"{workers} more processes per task. Received: STRATAGEM_CLUSTER_TOKEN set, "
            f"TF_CONFIG={env.get('TF_CONFIG', '')!r:.120}. Check launched_by_stratagem(env) "
            "and run the training directly in that case."
        )
    return launch([sys.executable, "-m", "stratagem", *command], workers=workers, env=env, sink=sink, **options)
