"""The parameter-server task: holds shards of the model's parameters and applies the user's optimizer.

The chief creates the shards (``Create``: initial values, the optimizer's class and the
hyper-parameters of each parameter group); workers read them (``Pull``, many shards in one call)
and send gradients (``Push``). A push applies the same torch optimizer the user built, with its
state (momentum buffers, Adam moments, step counts), to the shards it names, under a lock, so each
update is atomic and updates from different workers apply one after another (asynchronous
training: no worker waits for another). The optimizers torch ships update each element from its
own gradient and state, so updating a shard equals updating those rows of the whole tensor; an
optimizer that looks across a whole tensor (LBFGS, factored second moments) would need whole
tensors, which is what placement without a partitioner gives.

``Save`` returns every shard and its optimizer state; ``Load`` puts them back (checkpoints).

    >>> ps = ParameterServer(security=Security(token="t"), task="ps:0")   # doctest: +SKIP
    >>> ps.stopped(timeout=60.0)                                           # True once the chief ended the job
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from stratagem.errors import (
    ParameterServerError,
    WireFormatError,
)
from stratagem.strategies.parameter_server import wire
from stratagem.strategies.parameter_server.transport import (
    Reply,
    Security,
    Server,
    Streaming,
)

logger = logging.getLogger(__name__)

SERVICE = "stratagem.ParameterServer"
STATE_SEPARATOR = "#"


def optimizer_spec(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's class path and each group's hyper-parameters as JSON (no parameters, no state)."""
    cls = type(optimizer)
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        hyper = {}
        for key, value in group.items():
            if key == "params":
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, tuple):
                value = {"tuple": list(value)}
            if not isinstance(value, (int, float, bool, str, type(None), dict, list)):
                raise ParameterServerError(
                    f"An optimizer hyper-parameter cannot be sent to the parameter servers. Received: "
                    f"param_groups[{index}][{key!r}]={value!r:.80}. Fix: use numbers, booleans or tuples of them.")
            hyper[key] = value
        groups.append(hyper)
    return {"module": cls.__module__, "qualname": cls.__qualname__, "groups": groups}


def _hyper_from_json(hyper: dict[str, Any]) -> dict[str, Any]:
    return {key: tuple(value["tuple"]) if isinstance(value, dict) and set(value) == {"tuple"} else value
            for key, value in hyper.items()}


def resolve_optimizer_class(module: str, qualname: str) -> type[torch.optim.Optimizer]:
    """The optimizer class named by ``module`` and ``qualname``; refuses anything else."""
    # Only modules this task has already imported: a message never makes a task import (run) new code.
    target: Any = sys.modules.get(module)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if target is None:
        raise ParameterServerError(f"Cannot find the optimizer class on this task. Received: {module}.{qualname}. "
                                   "Fix: define it in a module every task imports (the same script runs everywhere).")
    if not (isinstance(target, type) and issubclass(target, torch.optim.Optimizer)):
        raise ParameterServerError(f"Not a torch optimizer class. Received: {module}.{qualname}={target!r:.80}. "
                                   "Fix: pass a torch.optim.Optimizer.")
    return target


def _build(cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """The optimizer over this server's shards, with torch's foreach kernels where the user left the choice
    to torch (same arithmetic, one call over many shards instead of a Python loop; torch picks the loop
    on a CPU)."""
    if all(g.get("foreach", False) is None and not g.get("fused") and not g.get("differentiable") for g in groups):
        try:
            return cls([{**g, "foreach": True} for g in groups])
        except (RuntimeError, TypeError, ValueError):
            pass  # this optimizer has no foreach kernel
    return cls(groups)


class ParameterServer:
    """One parameter-server task: a gRPC service over the shards it holds."""

    def __init__(self, *, security: Security, address: str = "127.0.0.1:0", task: str = "ps:0") -> None:
        self.task = task
        self._lock = threading.Lock()
        self._shards: dict[str, nn.Parameter] = {}
        self._optimizer: torch.optim.Optimizer | None = None
        self._grads: dict[str, torch.Tensor] = {}
        self._num_updates = 0
        self._shutdown = threading.Event()
        self._server = Server(SERVICE, {
            "Create": self._create, "Pull": self._pull, "Push": Streaming(self._push), "Save": self._save,
            "Load": self._load, "Shutdown": self._stop, "Ping": self._ping,
        }, security=security, address=address)
        self.address = self._server.address

    # ---- handlers ------------------------------------------------------------------------------
    def _create(self, op: str, meta: Any, tensors: dict[str, torch.Tensor]) -> Reply:
        groups_of = meta.get("groups", {}) if isinstance(meta, dict) else {}
        spec = meta.get("optimizer") if isinstance(meta, dict) else None
        if set(groups_of) != set(tensors):
            raise WireFormatError(f"Create needs a group for every shard. Received: shards {sorted(tensors)[:5]}, "
                                  f"groups for {sorted(groups_of)[:5]}. Fix: send both.")
        shards = {name: nn.Parameter(value.clone()) for name, value in tensors.items()}
        optimizer = None
        if spec is not None and shards:
            cls = resolve_optimizer_class(spec["module"], spec["qualname"])
            groups = []
            for index, hyper in enumerate(spec["groups"]):
                params = [shards[name] for name in tensors if groups_of[name] == index]
                if params:
                    groups.append({"params": params, **_hyper_from_json(hyper)})
            optimizer = _build(cls, groups)
        grads = {name: torch.empty_like(param) for name, param in shards.items()} if optimizer is not None else {}
        with self._lock:
            self._shards, self._optimizer, self._grads, self._num_updates = shards, optimizer, grads, 0
        logger.info("%s holds %d shards (%d elements), optimizer %s", self.task, len(shards),
                    sum(p.numel() for p in shards.values()), type(optimizer).__name__ if optimizer else None)
        return "created", {"shards": len(shards)}, {}

    def _known(self, names: Any) -> list[str]:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise WireFormatError(f"Shard names must be a list of strings. Received: {names!r:.120}. "
                                  "Fix: send meta={'names': [...]}.")
        unknown = [n for n in names if n not in self._shards]
        if unknown:
            raise WireFormatError(f"{self.task} holds no shard named {unknown[:3]}. Received: {len(names)} names. "
                                  f"Fix: pull only shards placed on {self.task} (it holds {len(self._shards)}); "
                                  "was the model distributed by this job's chief?")
        return names

    def _pull(self, op: str, meta: Any, tensors: dict[str, torch.Tensor]) -> Reply:
        with self._lock:
            names = self._known(meta.get("names") if isinstance(meta, dict) else None)
            # Encoded under the lock (the one copy of the values), so a push cannot tear a read.
            return wire.encode_chunks("values", {"version": self._num_updates},
                                      {name: self._shards[name].detach() for name in names})

    def _push(self, pieces: Iterator[bytes]) -> Reply:
        # The gradient bytes stream straight into buffers kept per shard (one copy, no page faults of a
        # fresh message); the lock is held from the first byte, so pushes apply one after another.
        with self._lock:
            if self._optimizer is None:
                raise ParameterServerError(f"{self.task} has no optimizer, so it cannot apply gradients. Received: a "
                                           "push before Create. Fix: distribute(model, optimizer) on the chief first.")
            _, _, names = wire.decode_into(pieces, self._grads, exact=False)
            params = [self._shards[name] for name in names]
            for name, param in zip(names, params):
                param.grad = self._grads[name]
            try:
                self._optimizer.step()
            finally:
                for param in params:
                    param.grad = None
            self._num_updates += 1
            return "applied", {"version": self._num_updates}, {}

    def _save(self, op: str, meta: Any, tensors: dict[str, torch.Tensor]) -> Reply:
        with self._lock:
            out = {name: p.detach().clone() for name, p in self._shards.items()}
            scalars: dict[str, dict[str, Any]] = {}
            if self._optimizer is not None:
                for name, param in self._shards.items():
                    for key, value in self._optimizer.state.get(param, {}).items():
                        if isinstance(value, torch.Tensor):
                            out[f"{name}{STATE_SEPARATOR}{key}"] = value.detach().clone()
                        else:
                            scalars.setdefault(name, {})[key] = value
            return "saved", {"scalars": scalars, "version": self._num_updates}, out

    def _load(self, op: str, meta: Any, tensors: dict[str, torch.Tensor]) -> Reply:
        with self._lock:
            values = {n: t for n, t in tensors.items() if STATE_SEPARATOR not in n}
            self._known(list(values))
            for name, value in values.items():
                self._shards[name].data.copy_(value)
            if self._optimizer is not None:
                for name in self._shards:
                    self._optimizer.state.pop(self._shards[name], None)
                for key, value in tensors.items():
                    if STATE_SEPARATOR in key:
                        name, state_key = key.split(STATE_SEPARATOR, 1)
                        self._known([name])
                        self._optimizer.state[self._shards[name]][state_key] = value.clone()
                scalars = meta.get("scalars", {}) if isinstance(meta, dict) else {}
                for name, state in scalars.items():
                    self._known([name])
                    self._optimizer.state[self._shards[name]].update(state)
        return "loaded", {"shards": len(values)}, {}

    def _stop(self, op: str, meta: Any, tensors: dict[str, torch.Tensor]) -> Reply:
        logger.info("%s: shutdown requested by the chief", self.task)
        self._shutdown.set()
        return "stopping", None, {}

    def _ping(self, op: str, meta: Any, tensors: dict[str, torch.Tensor]) -> Reply:
        return "pong", {"task": self.task, "shards": len(self._shards), "version": self._num_updates}, {}

    # ---- life cycle ----------------------------------------------------------------------------
    def stopped(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds for the chief's Shutdown; True once it came."""
        return self._shutdown.wait(timeout)

    def stop(self, grace: float = 0.0) -> None:
        """Stops serving; calls in flight get ``grace`` seconds (0: at once, as if the process died)."""
        self._shutdown.set()
        self._server.stop(grace=grace)
