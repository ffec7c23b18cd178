"""The client side of the parameter servers: where each shard lives, pull, push, checkpoints.

``ShardedVariables`` knows the placement (``partitioners.place``) and talks to every parameter
server: a pull asks each server once for all the shards it holds (one call per server, in
parallel), a push sends each server the gradient rows of its shards in one call. Errors name the
parameter server that failed (``ps:1 at 127.0.0.1:4242 failed Pull ...``).

Checkpoints are one file written with ``torch.save`` and read with ``weights_only=True``:
whole parameters (shards put back together) and the optimizer state of each parameter (per-row
state such as momentum or Adam moments put back together the same way; scalar state such as
Adam's step count taken from the first shard). A checkpoint can therefore be restored under a
different partitioner or number of parameter servers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import torch

from stratagem.errors import CollectiveTimeoutError, ParameterServerError
from stratagem.strategies.parameter_server.partitioners import Shard, shard_of
from stratagem.strategies.parameter_server.server import (
    SERVICE,
    STATE_SEPARATOR,
    optimizer_spec,
)
from stratagem.strategies.parameter_server.transport import Client, Security

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "stratagem.parameter_server/1"


class ShardedVariables:
    """A model's parameters as shards on parameter servers, seen from a chief or a worker."""

    def __init__(self, shards: Sequence[Shard], ps_addresses: Sequence[str], *, security: Security,
                 rpc_timeout: float = 60.0) -> None:
        self.shards = list(shards)
        self.rpc_timeout = rpc_timeout
        self._clients = [Client(address, SERVICE, security=security, task=f"ps:{i}")
                         for i, address in enumerate(ps_addresses)]
        self._by_ps: dict[int, list[Shard]] = {}
        for shard in self.shards:
            self._by_ps.setdefault(shard.ps, []).append(shard)
        self._pool = futures.ThreadPoolExecutor(max_workers=max(1, len(self._clients)), thread_name_prefix="ps-client")

    def _each_ps(self, call: Any) -> dict[int, Any]:
        """``call(ps_index, shards)`` for every server holding shards, in parallel; the first error wins."""
        if len(self._by_ps) == 1:
            ((ps, shards),) = self._by_ps.items()
            return {ps: call(ps, shards)}
        pending = {ps: self._pool.submit(call, ps, shards) for ps, shards in self._by_ps.items()}
        return {ps: future.result() for ps, future in pending.items()}

    # ---- chief ---------------------------------------------------------------------------------
    def create(self, parameters: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer | None) -> None:
        """Sends every shard's initial value and the optimizer to its parameter server."""
        spec = None if optimizer is None else optimizer_spec(optimizer)

        def call(ps: int, shards: list[Shard]) -> None:
            tensors = {s.name: shard_of(parameters[s.parameter].detach(), s) for s in shards}
            meta = {"optimizer": spec, "groups": {s.name: s.group for s in shards}}
            self._clients[ps].call("Create", "create", meta, tensors, timeout=self.rpc_timeout, wait_for_ready=True)

        self._each_ps(call)
        # Servers that hold no shard still get an empty Create, so a stale layout from an earlier job is cleared.
        for ps, client in enumerate(self._clients):
            if ps not in self._by_ps:
                client.call("Create", "create", {"optimizer": None, "groups": {}}, {}, timeout=self.rpc_timeout,
                            wait_for_ready=True)

    def shutdown(self, timeout: float = 5.0) -> list[str]:
        """Tells every parameter server to stop; returns the ones that could not be told."""
        missed = []
        for client in self._clients:
            try:
                client.call("Shutdown", "shutdown", timeout=timeout)
            except (ParameterServerError, CollectiveTimeoutError) as exc:  # a server already gone is fine here
                logger.info("%s: %s", client.task, exc)
                missed.append(client.task)
        return missed

    # ---- workers -------------------------------------------------------------------------------
    def pull_into(self, parameters: Mapping[str, torch.Tensor]) -> None:
        """Copies the current value of every shard into ``parameters`` (one call per server)."""
        def call(ps: int, shards: list[Shard]) -> None:
            names = {"names": [s.name for s in shards]}
            views = {s.name: shard_of(parameters[s.parameter], s).detach() for s in shards}
            if all(v.is_contiguous() and v.device.type == "cpu" for v in views.values()):
                # The fast path: received bytes go straight into the parameters, one copy.
                self._clients[ps].call_into("Pull", "pull", names, views, timeout=self.rpc_timeout)
                return
            _, _, values = self._clients[ps].call("Pull", "pull", names, timeout=self.rpc_timeout)
            with torch.no_grad():  # one foreach call instead of a Python loop over many small shards
                torch._foreach_copy_([shard_of(parameters[s.parameter], s) for s in shards],
                                     [values[s.name] for s in shards])

        self._each_ps(call)

    def push(self, gradients: Mapping[str, torch.Tensor | None]) -> None:
        """Sends the gradient rows of every shard to its server, which applies the optimizer.

        A parameter without a gradient (``None``: unused in this step) is not sent, so its
        optimizer state does not move, as torch's optimizers skip it.
        """
        def call(ps: int, shards: list[Shard]) -> None:
            tensors = {s.name: shard_of(gradients[s.parameter], s) for s in shards
                       if gradients.get(s.parameter) is not None}
            if tensors:
                self._clients[ps].call("Push", "push", None, tensors, timeout=self.rpc_timeout)

        self._each_ps(call)

    # ---- checkpoints ---------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Every parameter and its optimizer state, shards put back together."""
        replies = self._each_ps(lambda ps, shards: self._clients[ps].call("Save", "save", timeout=self.rpc_timeout))
        variables: dict[str, list[torch.Tensor]] = {}
        states: dict[str, dict[str, list[Any]]] = {}
        for shard in self.shards:
            _, meta, tensors = replies[shard.ps]
            variables.setdefault(shard.parameter, []).append(tensors[shard.name])
            state = states.setdefault(shard.parameter, {})
            prefix = f"{shard.name}{STATE_SEPARATOR}"
            for key, value in tensors.items():
                if key.startswith(prefix):
                    state.setdefault(key[len(prefix):], []).append(value)
            for key, value in meta["scalars"].get(shard.name, {}).items():
                state.setdefault(key, []).append(value)
        out_vars = {name: _join(parts) for name, parts in variables.items()}
        out_state = {name: {key: _join(parts) if _per_row(parts) else parts[0] for key, parts in state.items()}
                     for name, state in states.items()}
        return {"format": CHECKPOINT_FORMAT, "variables": out_vars, "optimizer_state": out_state}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Puts parameters and optimizer state back on the servers (any placement)."""
        variables, opt_state = state["variables"], state["optimizer_state"]
        missing = sorted({s.parameter for s in self.shards} - set(variables))
        if missing:
            raise ParameterServerError(f"The checkpoint lacks parameters of this model. Received: missing {missing[:5]}. "
                                       "Fix: restore a checkpoint written for this model.")

        def call(ps: int, shards: list[Shard]) -> None:
            tensors: dict[str, torch.Tensor] = {}
            scalars: dict[str, dict[str, Any]] = {}
            for s in shards:
                full = variables[s.parameter]
                tensors[s.name] = shard_of(full, s)
                for key, value in opt_state.get(s.parameter, {}).items():
                    if isinstance(value, torch.Tensor):
                        per_row = value.dim() > 0 and value.shape == full.shape
                        tensors[f"{s.name}{STATE_SEPARATOR}{key}"] = shard_of(value, s) if per_row else value
                    else:
                        scalars.setdefault(s.name, {})[key] = value
            self._clients[ps].call("Load", "load", {"scalars": scalars}, tensors, timeout=self.rpc_timeout)

        self._each_ps(call)

    def save(self, path: str | Path) -> None:
        """Writes ``state()`` to ``path`` (through a temporary file, so a crash leaves the old one)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(self.state(), tmp)
        tmp.replace(path)

    def restore(self, path: str | Path) -> None:
        """Loads a checkpoint written by ``save``."""
        state = torch.load(Path(path), weights_only=True)
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise ParameterServerError(f"Not a parameter-server checkpoint. Received: {str(path)!r} with format "
                                       f"{state.get('format') if isinstance(state, dict) else type(state).__name__!r}. "
                                       f"Fix: pass a file written by ParameterServerStrategy.save.")
        self.load_state(state)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for client in self._clients:
            client.close()


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0].clone() if len(parts) == 1 else torch.cat(parts)


def _per_row(parts: list[Any]) -> bool:
    return all(isinstance(p, torch.Tensor) and p.dim() > 0 for p in parts) and (
        len(parts) == 1 or len({p.shape[1:] for p in parts}) == 1)
