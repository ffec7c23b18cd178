"""``ParameterServerStrategy``: variables on parameter-server tasks, steps scheduled on workers.

The same script runs on every task of the cluster (TF_CONFIG, or ``stratagem launch --workers N --ps P``):

- on a ``ps`` task, constructing the strategy starts the parameter server and serves until the
  chief ends the job, then exits the process (``SystemExit(0)``);
- on a ``worker`` task, the script runs on until its first ``coordinator.schedule`` (by then its
  functions exist), serves scheduled functions there until the chief ends the job, then exits;
- on the chief (task ``chief``, else ``worker:0``, which then also works as a worker in a
  background thread, as ``stratagem launch`` has no separate chief) the script runs the
  training loop: ``distribute`` places the variables on the parameter servers and
  ``ClusterCoordinator`` schedules the steps.

Example (run it under ``stratagem launch --workers 2 --ps 1 train.py``):

    strategy = sg.ParameterServerStrategy(partitioner=sg.MinSizePartitioner(max_shards=2))
    model, optimizer = strategy.distribute(Net(), torch.optim.SGD(Net().parameters(), lr=0.1))
    coordinator = sg.ClusterCoordinator(strategy)
    ... coordinator.schedule(train_step, args=(iterator,)) ...
    coordinator.join()
    strategy.save("ckpt.pt")                   # variables and optimizer state

Every call between tasks carries the cluster token (``STRATAGEM_CLUSTER_TOKEN``, set by
``stratagem launch``, or ``cluster_token=``); TLS is on with ``certificate``/``private_key``.
``InProcessCluster`` runs parameter servers and workers as threads of this process on
127.0.0.1, for tests and for trying a script out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from stratagem import environ
from stratagem.cluster import Cluster, resolve_cluster
from stratagem.diagnose import PlacementDecision
from stratagem.errors import InputError
from stratagem.shm import eligibility
from stratagem.strategies.base import Strategy
from stratagem.strategies.explain import Explanation
from stratagem.strategies.parameter_server import fit_steps as fit_support
from stratagem.strategies.parameter_server import heartbeat, tasks
from stratagem.strategies.parameter_server.coordinator import ClusterCoordinator
from stratagem.strategies.parameter_server.partitioners import Partitioner, place
from stratagem.strategies.parameter_server.server import SERVICE as PS_SERVICE
from stratagem.strategies.parameter_server.tasks import CHIEF_SERVICE as CHIEF_SERVICE
from stratagem.strategies.parameter_server.tasks import STOP_GRACE_SECONDS as STOP_GRACE_SECONDS
from stratagem.strategies.parameter_server.tasks import InProcessCluster as InProcessCluster
from stratagem.strategies.parameter_server.tasks import TaskPlan
from stratagem.strategies.parameter_server.tracing import TraceSession
from stratagem.strategies.parameter_server.transport import Security, Server
from stratagem.strategies.parameter_server.variables import ShardedVariables, transfers_choice, transfers_reason
from stratagem.strategies.parameter_server.worker import (
    ParameterServerModel,
    ParameterServerOptimizer,
    WorkerService,
)
from stratagem.timeouts import check_seconds
from stratagem.trace import Recorder, Traceable
from stratagem.trace.recorder import Clock

logger = logging.getLogger(__name__)

# How often a ps or worker task pings the chief (passed to tasks.serve_as_*): a module constant, so tests shorten it.
CHIEF_CHECK_SECONDS = 2.0


class ParameterServerStrategy(Strategy, Traceable):
    """Asynchronous training with variables on parameter servers (tf.distribute's ``ParameterServerStrategy``).

    Args:
        cluster_resolver: a ``Cluster``, a TF_CONFIG dict, an ``InProcessCluster``, or None to read the
            environment (TF_CONFIG, as ``stratagem launch --ps P`` sets it).
        partitioner: how to cut parameters into shards (``FixedShardsPartitioner``, ``MinSizePartitioner``,
            ``MaxSizePartitioner``); None places whole tensors round-robin.
        cluster_token: the shared secret of the job; defaults to ``STRATAGEM_CLUSTER_TOKEN``.
        certificate, private_key, server_name: TLS (PEM paths); every task of the job uses the same ones.
        rpc_timeout: seconds a pull, push or checkpoint call may take.
        chief_timeout: seconds a ps or worker task keeps serving while the chief cannot be reached (it
            checks every few seconds); then it fails with an error naming the chief, so no task is left behind.
        ps_exit_delay: seconds a parameter server waits, once the chief has ended the job, before its
            process exits; a launcher that stops parameter servers after the workers (``stratagem launch``
            counts an early exit as a failure) stops it first.
        shared_memory: how values travel between a worker and a parameter server on the same host. None
            (the default): through a shared-memory file where they can (one copy each way, no gRPC
            message), over gRPC elsewhere, with a warning when one host cannot share memory; False: always
            over gRPC; True: an error where they cannot. ``explain()`` shows what was chosen.

    See the module docstring for how the same script runs on every task.
    """

    def __init__(
        self,
        cluster_resolver: Cluster | Mapping[str, Any] | InProcessCluster | None = None,
        partitioner: Partitioner | Callable[..., int] | None = None,
        *,
        cluster_token: str | None = None,
        certificate: str | None = None,
        private_key: str | None = None,
        server_name: str | None = None,
        rpc_timeout: float = 60.0,
        chief_timeout: float = 60.0,
        ps_exit_delay: float = 10.0,
        shared_memory: bool | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        env = environ.current() if env is None else env
        rpc_timeout = check_seconds("rpc_timeout", rpc_timeout)
        chief_timeout = check_seconds("chief_timeout", chief_timeout)
        ps_exit_delay = check_seconds("ps_exit_delay", ps_exit_delay, allow_zero=True)
        self._in_process = cluster_resolver if isinstance(cluster_resolver, InProcessCluster) else None
        if isinstance(cluster_resolver, InProcessCluster):
            cluster = cluster_resolver.cluster
            cluster_token = cluster_token or cluster_resolver.token
            if certificate is None:  # the in-process servers' TLS settings, unless given here
                certificate, server_name = cluster_resolver.security.certificate, cluster_resolver.security.server_name
        else:
            cluster = resolve_cluster(cluster_resolver, env=env)
        if partitioner is not None and not callable(partitioner):
            raise InputError(
                f"partitioner must be callable as partitioner(shape, dtype). Received: "
                f"{partitioner!r}. Pass FixedShardsPartitioner(n), MinSizePartitioner() "
                "or MaxSizePartitioner(bytes), or None."
            )
        if shared_memory not in (None, True, False):
            raise InputError(
                f"shared_memory must be None, True or False. Received: {shared_memory!r}. "
                "Pass None to use shared memory with servers on this host, False never to, "
                "True to insist."
            )
        eligibility.check_wanted(shared_memory, env)  # STRATAGEM_SHARED_MEMORY=0 against shared_memory=True
        self._switched_off = eligibility.turned_off(env) if shared_memory is None else None
        self._cluster = cluster
        self.partitioner = partitioner
        self.shared_memory = shared_memory
        self.rpc_timeout = rpc_timeout
        self.chief_timeout = chief_timeout
        self.ps_exit_delay = ps_exit_delay
        self.coordinator_timeouts: dict[str, float] | None = None
        """The waits of the ``ClusterCoordinator`` made for this strategy (set by it), stated by ``explain()``."""
        self._ps_addresses = list(cluster.addresses.get("ps", ()))
        if not self._ps_addresses:
            raise InputError(
                f"ParameterServerStrategy needs at least one parameter-server task. Received: a cluster from "
                f"{cluster.source} with tasks {dict(cluster.addresses)}. Run under `stratagem launch --workers 2 "
                "--ps 1`, or give TF_CONFIG a 'ps' list."
            )
        if not cluster.addresses.get("worker"):
            raise InputError(
                f"ParameterServerStrategy needs at least one worker task. Received: "
                f"{dict(cluster.addresses)}. Add a 'worker' list to the cluster."
            )
        token = cluster_token or env.get("STRATAGEM_CLUSTER_TOKEN")
        if not token:
            raise InputError(
                "No cluster token. Received: neither cluster_token= nor STRATAGEM_CLUSTER_TOKEN. Run under "
                "`stratagem launch` (it makes one), or give every task the same secret in STRATAGEM_CLUSTER_TOKEN."
            )
        security = Security(token=token, certificate=certificate, private_key=private_key, server_name=server_name)
        self._model: ParameterServerModel | None = None
        self._fit_coordinator: ClusterCoordinator | None = None
        self._shutdown_hooks: list[Callable[[], None]] = []
        self._worker_service: WorkerService | None = None
        self.tasks = TaskPlan(
            task=cluster.task_name,
            is_coordinator=cluster.task_type == "chief" or (cluster.is_chief and cluster.task_type == "worker"),
            workers_in_process=isinstance(cluster_resolver, InProcessCluster),
            workers=tuple((f"worker:{i}", a) for i, a in enumerate(cluster.addresses["worker"])),
            parameter_servers=tuple(self._ps_addresses),
            security=security,
        )
        """This task's place in the job (tasks.py): role, workers, parameter servers, security."""
        self.tracing = TraceSession(self.tasks, ps_service=PS_SERVICE, rpc_timeout=rpc_timeout)
        """The job's trace, driven by the coordinator (`tracing.py`); off until one starts."""
        task = cluster.task_name
        if cluster.task_type == "ps":
            self._serve_as_ps()
        elif cluster.task_type == "evaluator":
            raise InputError(
                f"This strategy has no evaluator role. Received: task {task}. Run evaluation in the chief's script."
            )
        elif cluster.task_type == "worker" and not self.tasks.workers_in_process:
            # Worker 0 inside the chief (no 'chief' task) is ready at once: the chief's script is already running.
            self._worker_service = WorkerService(
                task,
                security=self.tasks.security,
                address=cluster.addresses["worker"][cluster.task_index],
                ready=self.tasks.is_coordinator,
                recorder=self.tracing.recorder if self.tasks.is_coordinator else None,  # the chief's is this worker's
            )
        self._chief_server: Server | None = None
        if cluster.task_type == "chief" and not self.tasks.workers_in_process:
            # Parameter servers and workers ping it, so they stop serving when the chief is gone.
            self._chief_server = Server(
                CHIEF_SERVICE,
                {"Ping": lambda op, meta, tensors: ("pong", None, {})},
                security=self.tasks.security,
                address=cluster.addresses["chief"][0],
            )
        if self.tasks.is_coordinator:
            tasks.end_job_at_exit(self.shutdown)  # when the main thread ends, an error included
            directory = environ.trace_dir(env)  # `stratagem launch --trace DIR`: the whole run, written at shutdown
            if directory is not None:
                self.tracing.begin(directory)
        logger.info(
            "ParameterServerStrategy on %s: %d ps, %d workers, coordinator=%s",
            task,
            len(self._ps_addresses),
            len(cluster.addresses["worker"]),
            self.tasks.is_coordinator,
        )

    # ---- roles (tasks.py) ------------------------------------------------------------------------
    def _serve_as_ps(self) -> None:
        tasks.serve_as_ps(
            self.cluster,
            self.tasks.security,
            self._ps_addresses[self.cluster.task_index],
            chief_timeout=self.chief_timeout,
            check_seconds=CHIEF_CHECK_SECONDS,
            exit_delay=self.ps_exit_delay,
        )

    def serve_as_worker(self) -> None:
        """On a worker task: serves scheduled functions until the chief ends the job (raises SystemExit)."""
        tasks.serve_as_worker(
            self.cluster,
            self.tasks.security,
            self._worker_service,
            distributed=self._model is not None,
            chief_timeout=self.chief_timeout,
            check_seconds=CHIEF_CHECK_SECONDS,
        )

    def on_shutdown(self, hook: Callable[[], None]) -> None:
        """`hook` runs at `shutdown()` (the coordinator closes its dispatch threads there)."""
        self._shutdown_hooks.append(hook)

    # ---- the user's view ------------------------------------------------------------------------
    def distribute(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Places the model's parameters on the parameter servers (the chief sends their values and the optimizer).

        Returns ``(model, optimizer)``: the model runs each worker's replica inside scheduled functions;
        ``optimizer.step()`` pushes gradients, which the servers apply with ``optimizer``'s class,
        hyper-parameters and state.
        """
        if not isinstance(model, nn.Module):
            raise InputError(
                f"distribute needs a torch.nn.Module. Received: {type(model).__name__}. Pass the model itself."
            )
        if self._model is not None:
            raise InputError(
                "This strategy already holds a model. Received: a second distribute() call. "
                "Use one ParameterServerStrategy per model."
            )
        named = list(model.named_parameters())
        groups: dict[int, int] = {}
        if optimizer is not None:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise InputError(
                    f"optimizer must be a torch.optim.Optimizer. Received: "
                    f"{type(optimizer).__name__}. Build it over model.parameters()."
                )
            groups = {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}
            strangers = [name for name, p in named if id(p) not in groups]
            if len(groups) != len(named) or strangers:
                raise InputError(
                    f"The optimizer must hold exactly the model's parameters. Received: {len(groups)} optimizer "
                    f"parameters, {len(named)} model parameters, not in the optimizer: {strangers[:5]}. "
                    "Build the optimizer over model.parameters()."
                )
        shards = place(
            [(name, p, groups.get(id(p), 0)) for name, p in named], len(self._ps_addresses), self.partitioner
        )
        variables = ShardedVariables(
            shards,
            self._ps_addresses,
            security=self.tasks.security,
            rpc_timeout=self.rpc_timeout,
            shared_memory=self.shared_memory,
            task=self.cluster.task_name,
        )
        if self.tasks.is_coordinator:
            variables.create(dict(named), optimizer)
            self.tracing.placed()  # the parameter servers answer: a trace that records starts on them
        self._model = ParameterServerModel(model, shards, self._ps_addresses, variables, self.rpc_timeout)
        if optimizer is None:
            return self._model
        return self._model, ParameterServerOptimizer(optimizer, self._model)

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """Runs ``fn`` on this worker's replica (one replica per worker); use it inside scheduled functions."""
        return fn(*args, **(kwargs or {}))

    @property
    def local_devices(self) -> list[torch.device]:
        return [torch.device("cpu")]

    @property
    def is_chief(self) -> bool:
        """True in the coordinator, the task that drives training and reports."""
        return self.tasks.is_coordinator

    @property
    def distributed_model(self) -> ParameterServerModel | None:
        """The model `distribute` placed on the parameter servers (None before)."""
        return self._model

    def step(self, fn: Any = None, *, returns: str = "mean", batch_dims: Any = None) -> Any:
        """Refused: the coordinator schedules steps on the workers, no step runs on every replica at once."""
        raise InputError(
            "step has no meaning under ParameterServerStrategy: the coordinator schedules each step on one "
            f"worker with ClusterCoordinator.schedule, and workers run on their own. Received: step(returns={returns!r}). "
            "Train with sg.fit(model, strategy=...), which runs under every strategy, or schedule the step with "
            "sg.ClusterCoordinator(strategy).schedule(train_step, args=...)."
        )

    def barrier(self) -> None:
        """Refused: only the chief runs the training loop; the other tasks serve what it schedules."""
        raise InputError(
            "barrier has no meaning under ParameterServerStrategy: the chief runs the training loop, and workers "
            "run only the functions it schedules, after what the chief did before scheduling them. Received: "
            "barrier() on this task. Write the file before coordinator.schedule(...) and read it inside the "
            "scheduled function, or use strategy.save(path) for the variables."
        )

    def gather(self, value: Any, axis: int = 0) -> Any:
        """Refused: workers run scheduled functions on their own, with no step at which all their values meet."""
        raise InputError(
            "gather has no meaning under ParameterServerStrategy: each worker runs the functions the coordinator "
            f"schedules on its own, so there is no step at which every worker's values meet. Received: gather of "
            f"{type(value).__name__}. Return the values from the scheduled function and join what "
            "coordinator.fetch(...) gives on the coordinator, e.g. torch.cat(coordinator.fetch(remote_values))."
        )

    @property
    def cluster(self) -> Cluster:
        """The job's tasks (chief, workers, parameter servers) and this one's place among them."""
        return self._cluster

    @property
    def is_synchronous(self) -> bool:
        """False: each step runs on one worker, on its own schedule, and updates the variables when it lands."""
        return False

    @property
    def num_workers(self) -> int:
        """Worker tasks that run scheduled functions."""
        return len(self.cluster.addresses["worker"])

    @property
    def num_ps(self) -> int:
        """Parameter-server tasks."""
        return len(self._ps_addresses)

    # ---- sg.fit (see fit_steps.py) ----------------------------------------------------------------
    def prepare_fit_steps(self, steps: Mapping[str, Callable[..., Any]], model: Any) -> None:
        """`fit`'s step functions, on every task; a worker task serves them from here until the job ends."""
        fit_support.prepare_fit_steps(self, steps, model)

    def run_fit_steps(self, step_fn: Callable[..., Any], batches: Any, on_step: Callable[..., None]) -> None:
        """`fit`'s step loop on the chief: each global batch a step scheduled on a worker."""
        if self._fit_coordinator is None:
            self._fit_coordinator = ClusterCoordinator(self)
        fit_support.fit_steps(self._fit_coordinator, step_fn, batches, on_step)
        if self._model is not None:
            self._model.pull()  # the chief's copy (history.model) shows the trained values

    writes_every_file: ClassVar[bool] = True  # the chief stops every task's trace, which replies once written

    def trace(
        self, directory: str | Path, *, clock: Clock | None = None, mode: str = "spans"
    ) -> AbstractContextManager[Recorder]:
        """On the coordinator: records every task's work while the block runs (each function on its worker, with its
        pulls and pushes, each server's updates, each dispatch; tracing.py), each task's file written as it ends.

            >>> with strategy.trace("traces/"):
            ...     losses = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(50)]
            ...     coordinator.join()
        """
        return self.tracing.trace(directory, clock=clock, mode=mode)

    def close(self) -> None:
        """Ends the job, as `shutdown` (the name every stratagem strategy answers to)."""
        self.shutdown()

    def save(self, path: str) -> None:
        """Writes every variable and its optimizer state to ``path`` (on the chief; other tasks do nothing)."""
        if self.tasks.is_coordinator:
            self._require_model("save").save(path)

    def restore(self, path: str) -> None:
        """Puts variables and optimizer state from ``path`` back on the parameter servers (chief only)."""
        if self.tasks.is_coordinator:
            self._require_model("restore").restore(path)
            self._model.pull()  # type: ignore[union-attr]

    def _require_model(self, what: str) -> ShardedVariables:
        if self._model is None:
            raise InputError(
                f"{what} needs a distributed model. Received: none yet. "
                "Call strategy.distribute(model, optimizer) first."
            )
        return self._model.variables

    def shutdown(self) -> None:
        """Ends the job (chief): the coordinator stops, workers and parameter servers are told to exit."""
        if not self.tasks.is_coordinator:
            return
        tasks.forget_at_exit(self.shutdown)
        self.tracing.end()  # a whole run's trace (STRATAGEM_TRACE): every task writes its file while it still serves
        for hook in self._shutdown_hooks:
            hook()
        self._shutdown_hooks.clear()
        if not self.tasks.workers_in_process:
            tasks.stop_workers(self.tasks, self._worker_service)
            if self._model is not None:
                self._model.variables.shutdown()
            else:
                ShardedVariables([], self._ps_addresses, security=self.tasks.security).shutdown()
        if self._worker_service is not None:
            self._worker_service.stop(grace=STOP_GRACE_SECONDS)
        if self._chief_server is not None:
            self._chief_server.stop(grace=STOP_GRACE_SECONDS)

    def _transfers(self) -> dict[str, str]:
        """How this process's tasks reach each parameter server, as decided so far (at their first pull)."""
        clients = [self._model.variables] if self._model is not None else []
        services = self._in_process.workers if self._in_process is not None else [self._worker_service]
        for service in services:
            if service is not None:
                clients += service.runtime.variables()
        return {f"{v.task} -> {ps}": how for v in clients for ps, how in v.transfers.items()}

    def explain(self) -> Explanation:
        """Tasks, where the variables live and why."""
        shards = self._model.shards if self._model is not None else []
        placement = (
            f"whole tensors round-robin over {self.num_ps} parameter servers"
            if self.partitioner is None
            else f"cut by {self.partitioner!r}, shards round-robin over {self.num_ps} parameter servers"
        )
        decisions = [
            PlacementDecision(
                subject="task", choice=self.cluster.task_name, reason=f"cluster from {self.cluster.source}"
            ),
            PlacementDecision(
                subject="variables",
                choice=f"{len(shards)} shards" if self._model is not None else "not placed yet",
                reason=placement
                if self._model is not None
                else f"distribute(model, optimizer) will place them: {placement}",
            ),
            PlacementDecision(
                subject="updates",
                choice="asynchronous",
                reason="each parameter server applies a worker's gradients when they arrive",
            ),
        ]
        decisions.append(
            PlacementDecision(
                subject="values between workers and parameter servers",
                choice=transfers_choice(self._transfers(), self._switched_off, self.shared_memory),
                reason=transfers_reason(self._transfers(), self._switched_off, self.shared_memory),
            )
        )
        decisions.append(heartbeat.lost_workers_decision(self.coordinator_timeouts))
        details = {
            "workers": list(self.cluster.addresses["worker"]),
            "ps": self._ps_addresses,
            "tls": self.tasks.security.tls,
            "shards": {s.name: f"ps:{s.ps} rows {s.start}:{s.stop}" for s in shards}
            if self._model is not None
            else "placed by distribute(model, optimizer)",
        }
        return Explanation(
            strategy="ParameterServerStrategy",
            num_replicas_in_sync=1,
            replicas=[],
            decisions=decisions,
            details=details,
        )
