"""The tasks other than the chief: parameter servers and workers, serving until the chief ends the job.

In a cluster of processes, a ``ps`` task runs a ``ParameterServer`` and a ``worker`` task a
``WorkerService`` (``serve_as_ps``, ``serve_as_worker``, called by ``ParameterServerStrategy`` on
those tasks); each pings the chief every few seconds and stops when the chief ends the job, or
fails with an error naming the chief when it has not answered for ``chief_timeout`` seconds, so
no task is left serving a job that is gone. ``InProcessCluster`` runs the same servers in this
process instead, on 127.0.0.1 free ports, for tests and for trying a script out.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from stratagem.cluster import Cluster, free_ports
from stratagem.errors import CollectiveTimeoutError, InputError, ParameterServerError
from stratagem.strategies.parameter_server.server import ParameterServer
from stratagem.strategies.parameter_server.transport import Client, Security
from stratagem.strategies.parameter_server.worker import SERVICE as WORKER_SERVICE
from stratagem.strategies.parameter_server.worker import WorkerService

if TYPE_CHECKING:
    from stratagem.strategies.parameter_server.tracing import TraceSession
    from stratagem.strategies.parameter_server.worker import ParameterServerModel


@dataclass(frozen=True)
class TaskPlan:
    """This task's place in a parameter-server job, worked out from the cluster before any server starts (as
    `cluster.worker_group.WorkerGroupPlan` is for a worker group): what the strategy, its coordinator and
    `fit`'s steps read of it."""

    task: str
    """This task's name, e.g. "chief", "worker:1", "ps:0"."""
    is_coordinator: bool
    """This task drives training: the chief, or worker 0 when the cluster has no chief."""
    workers_in_process: bool
    """The workers are threads of this process (an `InProcessCluster`), not tasks of their own."""
    workers: tuple[tuple[str, str], ...]
    """(task, address) of each worker, whose service the coordinator calls."""
    parameter_servers: tuple[str, ...]
    """Each parameter server's address, by index."""
    security: Security
    """The cluster token and TLS settings every RPC of this job uses."""


class ParameterServerTasks(Protocol):
    """What the coordinator and `fit`'s steps use of a ParameterServerStrategy (coordinator.py, fit_steps.py):
    its task plan, the hook at shutdown, the model it placed, the job's trace. Declared here, below the strategy, so
    that neither imports the strategy's module."""

    tasks: TaskPlan
    coordinator_timeouts: dict[str, float] | None
    tracing: TraceSession

    @property
    def distributed_model(self) -> ParameterServerModel | None: ...

    def on_shutdown(self, hook: Callable[[], None]) -> None: ...

    def serve_as_worker(self) -> None: ...


logger = logging.getLogger(__name__)

CHIEF_SERVICE = "stratagem.Chief"
STOP_GRACE_SECONDS = 1.0


class InProcessCluster:
    """Parameter servers and workers as gRPC servers in this process, on 127.0.0.1 free ports.

    Example:
        >>> with InProcessCluster(num_workers=2, num_ps=1) as cluster:          # doctest: +SKIP
        ...     strategy = ParameterServerStrategy(cluster_resolver=cluster)
    """

    def __init__(
        self,
        num_workers: int = 2,
        num_ps: int = 1,
        *,
        token: str | None = None,
        certificate: str | None = None,
        private_key: str | None = None,
        server_name: str | None = None,
    ) -> None:
        for name, value in (("num_workers", num_workers), ("num_ps", num_ps)):
            if not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be at least 1. Received: {name}={value!r}. Pass an int >= 1.")
        self.token = token or secrets.token_hex(16)
        self.security = Security(
            token=self.token, certificate=certificate, private_key=private_key, server_name=server_name
        )
        self.ps = [ParameterServer(security=self.security, task=f"ps:{i}") for i in range(num_ps)]
        self.workers = [WorkerService(f"worker:{i}", security=self.security) for i in range(num_workers)]
        config = {
            "cluster": {
                "chief": [f"127.0.0.1:{free_ports(1)[0]}"],
                "worker": [w.address for w in self.workers],
                "ps": [p.address for p in self.ps],
            },
            "task": {"type": "chief", "index": 0},
        }
        self.cluster = Cluster.from_tf_config(config)

    def kill_worker(self, index: int) -> None:
        """Stops worker ``index`` at once, as if its process died."""
        self.workers[index].stop()

    def restart_worker(self, index: int) -> None:
        """Starts worker ``index`` again on its address, with a fresh replica and fresh iterators."""
        self.workers[index] = WorkerService(
            f"worker:{index}", security=self.security, address=self.workers[index].address
        )

    def kill_ps(self, index: int) -> None:
        """Stops parameter server ``index`` at once, as if its process died."""
        self.ps[index].stop()

    def stop(self) -> None:
        servers: list[WorkerService | ParameterServer] = [*self.workers, *self.ps]
        for server in servers:
            server.stop()

    def __enter__(self) -> InProcessCluster:  # noqa: PYI034 - Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_as_ps(
    cluster: Cluster,
    security: Security,
    address: str,
    *,
    chief_timeout: float,
    check_seconds: float,
    exit_delay: float,
) -> None:
    """Serves this ``ps`` task's shards until the chief ends the job, waits ``exit_delay`` s, then exits."""
    server = ParameterServer(security=security, address=address, task=cluster.task_name)
    try:
        serve_while_chief_lives(
            cluster, security, server.stopped, chief_timeout=chief_timeout, check_seconds=check_seconds
        )
    finally:
        server.stop(grace=STOP_GRACE_SECONDS)  # the chief's Shutdown call gets its reply
    time.sleep(exit_delay)
    raise SystemExit(0)


def serve_as_worker(
    cluster: Cluster,
    security: Security,
    service: WorkerService | None,
    *,
    distributed: bool,
    chief_timeout: float,
    check_seconds: float,
) -> None:
    """Serves scheduled functions on this ``worker`` task (its model ``distributed``) until the chief ends the job,
    then exits."""
    if service is None:  # pragma: no cover - only a worker task gets here
        raise ParameterServerError(
            f"{cluster.task_name} has no worker service. Received: a call that serves "
            "on a task that is not a worker. Report this as a bug."
        )
    if not distributed:
        raise InputError(
            f"{cluster.task_name} reached coordinator.schedule before "
            "strategy.distribute(model, optimizer). Received: no distributed model. "
            "Distribute the model before scheduling, in the script every task runs."
        )
    service.ready.set()
    logger.info("%s serving scheduled functions", cluster.task_name)
    try:
        serve_while_chief_lives(
            cluster, security, service.stopped, chief_timeout=chief_timeout, check_seconds=check_seconds
        )
    finally:
        service.stop(grace=STOP_GRACE_SECONDS)
    raise SystemExit(0)


_at_exit: list[Callable[[], None]] = []
"""The coordinators' `shutdown`s still to run when the main thread ends (`end_job_at_exit`)."""
_hooked = threading.Event()  # `_run_at_exit` is registered (once per process)


def end_job_at_exit(shutdown: Callable[[], None]) -> None:
    """Runs ``shutdown`` (the chief ending the job) when the main thread ends, an error included, unless
    ``forget_at_exit`` was called first. It runs before the interpreter stops every thread pool, as concurrent.futures'
    own hook does: at atexit gRPC's pools no longer serve, so this process's own worker service (worker 0 in the chief)
    would not answer, and each call to it would wait out its timeout. CPython has no public hook that runs so early."""
    if not _hooked.is_set():
        threading._register_atexit(_run_at_exit)  # type: ignore[attr-defined]  # CPython's; not in typeshed
        _hooked.set()
    _at_exit.append(shutdown)


def forget_at_exit(shutdown: Callable[[], None]) -> None:
    """``shutdown`` has run (or will be run otherwise): the main thread's end no longer runs it."""
    if shutdown in _at_exit:
        _at_exit.remove(shutdown)


def _run_at_exit() -> None:
    for shutdown in reversed(list(_at_exit)):  # the last made first, as atexit does
        try:
            shutdown()
        except Exception:  # the next job still ends
            logger.exception("ending a parameter-server job as the main thread ended failed")


def stop_workers(plan: TaskPlan, own: WorkerService | None, *, timeout: float = 5.0) -> None:
    """The chief ending the job: tells every worker task to exit, each call bounded by ``timeout`` s. This process's
    own worker (``own``: worker 0 when the chief is also a worker) is skipped: its owner stops it in place."""
    for task, address in plan.workers:
        if own is not None and task == own.task:
            continue
        client = Client(address, WORKER_SERVICE, security=plan.security, task=task)
        try:
            client.call("Shutdown", "shutdown", timeout=timeout)
        except (ParameterServerError, CollectiveTimeoutError) as exc:  # a worker already gone is fine at shutdown
            logger.info("%s: %s", task, exc)
        finally:
            client.close()


def serve_while_chief_lives(
    cluster: Cluster,
    security: Security,
    stopped: Callable[[float], bool],
    *,
    chief_timeout: float,
    check_seconds: float,
) -> None:
    """Returns when ``stopped`` (the chief ended the job); raises when the chief has been unreachable for
    ``chief_timeout`` s. The chief is pinged every ``check_seconds``."""
    if "chief" in cluster.addresses:
        chief_task, address, service = "chief:0", cluster.addresses["chief"][0], CHIEF_SERVICE
    else:
        chief_task, address, service = "worker:0", cluster.addresses["worker"][0], WORKER_SERVICE
    chief = Client(address, service, security=security, task=chief_task)
    last_seen = time.monotonic()
    try:
        while not stopped(check_seconds):
            try:
                chief.call("Ping", "ping", timeout=check_seconds)
                last_seen = time.monotonic()
            except (ParameterServerError, CollectiveTimeoutError) as exc:
                silent = time.monotonic() - last_seen
                if silent > chief_timeout:
                    raise CollectiveTimeoutError(
                        f"{cluster.task_name} lost the chief: {chief_task} at {address} has not answered for "
                        f"{silent:.0f} s. Received: {exc}. The chief died or ended without telling this task; "
                        "restart the job (it resumes from its last checkpoint)."
                    ) from None
    finally:
        chief.close()
