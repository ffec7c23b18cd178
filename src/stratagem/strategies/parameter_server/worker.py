"""The worker side: a gRPC service that runs scheduled functions, and the model seen from inside them.

A worker task serves ``Run`` calls from the chief: each names a function (see ``functions``),
its arguments, and the per-worker datasets they use. The worker runs one function at a time.
Inside it, the distributed model (``ParameterServerModel``) stands for this worker's own replica:
its first forward pass in each function pulls the current parameters from the parameter servers,
``backward`` runs locally, and ``optimizer.step()`` pushes the gradients, which each parameter
server applies with the user's optimizer (asynchronous training: workers never wait for each other).

Several workers can live in one process (the in-process test cluster, or worker 0 inside the
chief when TF_CONFIG has no ``chief`` task): each has its own replica, chosen through a context
variable set while it runs a function, so the user's code stays ``model(x)`` everywhere.
"""

from __future__ import annotations

import contextvars
import copy
import logging
import threading
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from stratagem.errors import CollectiveTimeoutError, InputError, ParameterServerError
from stratagem.strategies.parameter_server import functions
from stratagem.strategies.parameter_server.partitioners import Shard
from stratagem.strategies.parameter_server.tracing import TaskTrace, function_ended, function_started, span
from stratagem.strategies.parameter_server.transport import LARGE, SMALL, Reply, Security, Server, task_lost
from stratagem.strategies.parameter_server.variables import ShardedVariables
from stratagem.trace.recorder import Recorder

logger = logging.getLogger(__name__)

SERVICE = "stratagem.Worker"
_current: contextvars.ContextVar[WorkerRuntime | None] = contextvars.ContextVar("stratagem_ps_worker", default=None)


def current_worker() -> WorkerRuntime | None:
    """The worker whose scheduled function is running in this thread, or ``None`` (the chief's own code)."""
    return _current.get()


class ParameterServerModel(nn.Module):
    """The user's model under ``ParameterServerStrategy``: variables live on the parameter servers.

    Inside a scheduled function it runs the current worker's replica, refreshed from the
    parameter servers at its first forward pass in that function; outside (on the chief) it runs
    the chief's copy, which ``pull()`` refreshes.
    """

    def __init__(
        self,
        module: nn.Module,
        shards: list[Shard],
        ps_addresses: list[str],
        variables: ShardedVariables,
        rpc_timeout: float,
    ) -> None:
        super().__init__()
        self.module = module
        self.shards = shards
        """Which parameter server holds each parameter (`layout.place`)."""
        self._ps_addresses = ps_addresses
        self.variables = variables
        """The parameter servers' clients: pull the values, push the gradients."""
        self._rpc_timeout = rpc_timeout
        object.__setattr__(self, "_ready", True)

    # A change of the model outside the step: on a worker (inside a scheduled function) its replica's; on the
    # coordinator refused, since the workers' replicas are copies in other processes that it never reaches.
    def __setattr__(self, name: str, value: Any) -> None:
        if not self.__dict__.get("_ready") or name == "training":
            # nn.Module's own, while __init__ builds this wrapper; `train()`/`eval()` as before (fit's loop sets the
            # mode of each scheduled function through it).
            super().__setattr__(name, value)
            return
        setattr(self._changed_module(f"model.{name} = ..."), name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._changed_module(f"del model.{name}"), name)

    def __getattr__(self, name: str) -> Any:
        # An attribute of the model (`model.use_aux`, `model.head`) read as on one device: this worker's replica's
        # inside a scheduled function, the coordinator's copy outside.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") or "_ready" not in self.__dict__:
                raise
        runtime = current_worker()
        return getattr(self.module if runtime is None else runtime.replica(self, pull=False), name)

    def requires_grad_(self, requires_grad: bool = True) -> ParameterServerModel:
        self._changed_module(f"model.requires_grad_({requires_grad})").requires_grad_(requires_grad)
        return self

    def apply(self, fn: Any) -> ParameterServerModel:  # type: ignore[override]
        self._changed_module("model.apply(fn)").apply(fn)
        return self

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        self._changed_module(f"model.register_buffer({name!r}, ...)").register_buffer(name, tensor, persistent)

    def _changed_module(self, what: str) -> nn.Module:
        runtime = current_worker()
        if runtime is not None:
            return runtime.replica(self, pull=False)
        raise InputError(
            "Under ParameterServerStrategy the model runs as a replica on each worker, a copy in another process, so "
            "a change made to it on the coordinator after distribute() would reach no worker and they would train "
            f"another model than the one this process holds. Received: {what} on the coordinator, outside a "
            "scheduled function. Make the change before strategy.distribute(), or inside the function given to "
            "coordinator.schedule (where it changes that worker's replica)."
        )

    def _target(self) -> nn.Module:
        runtime = current_worker()
        return self.module if runtime is None else runtime.replica(self, pull=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        target = self._target()  # the pull, on a worker's first forward in a function: a wait of its own
        runtime = current_worker()
        with span(None if runtime is None else runtime.recorder, "forward", "forward"):
            return target(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:  # the replica's, inside a function
        runtime = current_worker()
        return (self.module if runtime is None else runtime.replica(self, pull=False)).parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:
        runtime = current_worker()
        target = self.module if runtime is None else runtime.replica(self, pull=False)
        return target.named_parameters(prefix, recurse, remove_duplicate)

    def pull(self) -> nn.Module:
        """Copies the current values from the parameter servers into this task's copy; returns it."""
        runtime = current_worker()
        if runtime is not None:
            return runtime.replica(self, pull=True)
        self.variables.pull_into(dict(self.module.named_parameters()))
        return self.module


class ParameterServerOptimizer:
    """The optimizer seen by the step function: ``step()`` pushes this worker's gradients.

    The update itself runs on the parameter servers, with the user's optimizer (``.optimizer``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: ParameterServerModel) -> None:
        self.optimizer = optimizer
        self._model = model

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def step(self, closure: None = None) -> None:
        """Sends the gradients of this worker's replica to the parameter servers."""
        runtime = current_worker()
        if runtime is None or closure is not None:
            raise InputError(
                f"optimizer.step() pushes a worker's gradients, so it runs inside a scheduled function, without a "
                f"closure. Received: a call {'with a closure' if closure is not None else 'on the chief'}. "
                "Call it in the function given to coordinator.schedule."
            )
        runtime.push(self._model)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients of this worker's replica (or of the chief's copy outside a function)."""
        runtime = current_worker()
        target = self._model.module if runtime is None else runtime.replica(self._model, pull=False)
        target.zero_grad(set_to_none=set_to_none)


class WorkerRuntime:
    """One worker's replicas, parameter-server clients and iterators."""

    def __init__(self, task: str, security: Security, recorder: Recorder | None = None) -> None:
        self.task = task
        self._security = security
        self.recorder = recorder
        """Where each function, forward, optimizer step, pull and push is recorded while a trace is on."""
        self._replicas: dict[int, tuple[nn.Module, ShardedVariables]] = {}
        self._pulled: set[int] = set()
        self._iterators: dict[str, Iterator[Any]] = {}
        self._lock = threading.Lock()

    def replica(self, model: ParameterServerModel, *, pull: bool) -> nn.Module:
        key = id(model)
        if key not in self._replicas:
            variables = ShardedVariables(
                model.shards,
                model._ps_addresses,
                security=self._security,
                rpc_timeout=model._rpc_timeout,
                shared_memory=model.variables.shared_memory,
                task=self.task,
            )
            replica = copy.deepcopy(model.module)
            variables.arrange(dict(replica.named_parameters()))
            variables.recorder = self.recorder
            self._replicas[key] = (replica, variables)
        replica, variables = self._replicas[key]
        if pull and key not in self._pulled:
            variables.pull_into(dict(replica.named_parameters()))
            self._pulled.add(key)
        return replica

    def push(self, model: ParameterServerModel) -> None:
        entry = self._replicas.get(id(model))
        if entry is None:
            raise InputError(
                f"optimizer.step() before the model ran on {self.task}. Received: no forward "
                "pass in this function. Run the model, then backward, then step."
            )
        replica, variables = entry
        with span(self.recorder, "optimizer", "optimizer step"):
            variables.push({name: p.grad for name, p in replica.named_parameters()})

    def run(
        self,
        fn_ref: Any,
        args_tree: Any,
        kwargs_tree: Any,
        tensors: dict[str, torch.Tensor],
        datasets: dict[str, Any],
        closure: Any = None,
    ) -> Any:
        """Runs one scheduled function here; returns its result. `closure`: its number, name and attempt, as the
        coordinator sent them (the trace files its spans under them)."""
        with self._lock:
            fn = functions.resolve_function(fn_ref)
            for dataset_id, dataset_ref in datasets.items():
                if dataset_id not in self._iterators:
                    self._iterators[dataset_id] = iter(functions.resolve_function(dataset_ref)())
            refs = self._resolve_ref
            args = functions.decode(args_tree, tensors, refs)
            kwargs = functions.decode(kwargs_tree, tensors, refs)
            self._pulled.clear()
            token = _current.set(self)
            started = function_started(self.recorder, closure)
            try:
                return fn(*args, **kwargs)
            finally:
                function_ended(self.recorder, closure, started)
                _current.reset(token)

    def _resolve_ref(self, tree: dict[str, Any]) -> Any:
        if set(tree) == {"$iter"} and tree["$iter"] in self._iterators:
            return self._iterators[tree["$iter"]]
        raise ParameterServerError(
            f"Unknown reference on {self.task}. Received: {tree!r:.120}. "
            "Pass iterators made by coordinator.create_per_worker_dataset."
        )

    def variables(self) -> list[ShardedVariables]:
        """The parameter-server clients of this worker's replicas."""
        return [variables for _, variables in self._replicas.values()]

    def close(self) -> None:
        for _, variables in self._replicas.values():
            variables.close()


def _lost_ps(exc: BaseException) -> str | None:
    """The parameter server that could not be reached, when that is what ``exc`` says."""
    task = getattr(exc, "task", None)
    return task if task_lost(exc) and isinstance(task, str) and task.startswith("ps:") else None


class WorkerService:
    """The gRPC service of one worker task; ``ready`` opens it once the script has defined its functions."""

    def __init__(
        self,
        task: str,
        *,
        security: Security,
        address: str = "127.0.0.1:0",
        ready: bool = True,
        ready_timeout: float = 300.0,
        recorder: Recorder | None = None,
    ) -> None:
        self.task = task
        self.trace = TaskTrace(task, recorder)
        """This worker's trace, started and stopped by the chief (`tracing.py`); `recorder`: the chief's own, when
        the chief is this worker."""
        self.runtime = WorkerRuntime(task, security, self.trace.recorder)
        self.ready = threading.Event()
        if ready:
            self.ready.set()
        self._ready_timeout = ready_timeout
        self._shutdown = threading.Event()
        self._server = Server(
            SERVICE,
            {"Run": self._run, "Shutdown": self._stop, "Ping": self._ping, "Trace": self.trace.handle},
            security=security,
            address=address,
            default_limit=SMALL,
            limits={"Run": LARGE},
        )
        self.address = self._server.address

    def _run(self, op: str, meta: Any, tensors: dict[str, torch.Tensor]) -> Reply:
        if not self.ready.wait(self._ready_timeout):
            raise CollectiveTimeoutError(
                f"{self.task} never reached coordinator.schedule in its script within "
                f"{self._ready_timeout:g} s. Received: a Run call. Run the same script "
                "on every task."
            )
        try:
            result = self.runtime.run(
                meta["fn"], meta["args"], meta["kwargs"], tensors, meta["datasets"], meta.get("closure")
            )
            encoder = functions.Encoder()
            tree = encoder.encode(result, "the scheduled function's result")
            return "result", {"value": tree}, encoder.tensors
        except Exception as exc:  # noqa: BLE001 - every error of the user's function goes back to the chief
            info: dict[str, Any] = functions.describe_error(exc)
            info["traceback"] = traceback.format_exc()
            info["ps_lost"] = _lost_ps(exc)
            logger.info("%s: scheduled function failed: %s", self.task, exc)
            return "error", info, {}

    def _stop(self, op: str, meta: Any, tensors: dict[str, torch.Tensor]) -> Reply:
        logger.info("%s: shutdown requested by the chief", self.task)
        self._shutdown.set()
        return "stopping", None, {}

    def _ping(self, op: str, meta: Any, tensors: dict[str, torch.Tensor]) -> Reply:
        return "pong", {"task": self.task, "ready": self.ready.is_set()}, {}

    def stopped(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds for the chief's Shutdown; True once it came."""
        return self._shutdown.wait(timeout)

    def stop(self, grace: float = 0.0) -> None:
        """Stops serving; calls in flight get ``grace`` seconds (0: at once, as if the process died)."""
        self._shutdown.set()
        self._server.stop(grace=grace)
        self.runtime.close()
