"""Replicas that share one copy of the parameters, each updating 1/N of it.

When every replica lives on the same physical device (logical CPU devices), N private copies
of the parameters, gradients and optimizer state only compete for the same caches and memory
bandwidth. Instead the replicas' parameters alias one storage; each replica still computes
its own gradients (and, once they are combined, holds the full combined gradient, so clipping
works as on one device), but replica r's optimizer updates only elements [lo_r, hi_r) of every
parameter, and the optimizer state exists once. The replicas meet after the update, before
any of them reads the parameters again.

This is exact only for optimizers whose update of an element depends on that element alone
(`ELEMENTWISE_OPTIMIZERS`); others keep private copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from stratagem.errors import InputError
from stratagem.strategies.data_parallel.distributed import (
    KERNEL_KEYS,
    ReplicatedOptimizer,
    _copy_hyperparameters,
    clone_optimizer,
    traced_step,
)
from stratagem.strategies.replica_context import ReplicaMeeting

ELEMENTWISE_OPTIMIZERS: frozenset[type[torch.optim.Optimizer]] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.RMSprop,
        torch.optim.Rprop,
        torch.optim.ASGD,
    }
)
"""torch's optimizers whose update of an element reads only that element's value, gradient and state
(and scalars such as the step count, equal everywhere), so steps over the pieces of a tensor equal
one step over the whole: Mirrored's shared parameters and the parameter servers' buckets rely on it.
Exact classes only: a subclass may change the arithmetic."""


def chunk_bounds(numel: int, replica: int, num_replicas: int) -> tuple[int, int]:
    """Elements [lo, hi) of a flattened tensor that `replica` owns."""
    return numel * replica // num_replicas, numel * (replica + 1) // num_replicas


def alias_parameters(replicas: Sequence[nn.Module]) -> None:
    """Makes every replica's parameters share replica 0's storage (buffers stay private)."""
    for replica in replicas[1:]:
        for mine, primary in zip(replica.parameters(), replicas[0].parameters()):
            mine.data = primary.data


def why_not_shareable(optimizer: torch.optim.Optimizer | None, model: nn.Module) -> str | None:
    """Why parameters cannot be shared for this optimizer and model, or None when they can."""
    if optimizer is not None and type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        return f"{type(optimizer).__name__} is not known to update each element independently"
    if any(not p.is_contiguous() for p in model.parameters()):
        return "the model has non-contiguous parameters"
    return None


class ShardedOptimizer(ReplicatedOptimizer):
    """The optimizer `distribute` returns when replicas share parameters.

    Inside `Strategy.run`, `step()` updates this replica's share of every parameter and then
    waits for the other replicas; `state_dict()` is in the format of the optimizer given to
    `distribute`, whole tensors, so checkpoints do not depend on the number of replicas.
    """

    def __init__(
        self, template: torch.optim.Optimizer, replica_params: Sequence[Sequence[nn.Parameter]], host: ReplicaMeeting
    ) -> None:
        # torch.optim.Optimizer.__init__ is not called: this object owns no parameters of its own.
        self._template = template
        self._host = host
        self._replica_params = [list(ps) for ps in replica_params]
        self._start_watch()
        source = self._replica_params[0]
        index = {id(p): i for i, p in enumerate(source)}
        self._order = [index[id(p)] for group in template.param_groups for p in group["params"]]
        num_replicas = len(self._replica_params)
        self._bounds = [
            [chunk_bounds(source[i].numel(), r, num_replicas) for i in self._order] for r in range(num_replicas)
        ]
        self._optimizers = []
        for r in range(num_replicas):
            shards = [nn.Parameter(source[i].data.view(-1)[lo:hi]) for i, (lo, hi) in zip(self._order, self._bounds[r])]
            mapping = {id(source[i]): shard for i, shard in zip(self._order, shards)}
            shard_optimizer = clone_optimizer(template, mapping, with_state=False)
            _prefer_fast_kernels(shard_optimizer)
            self._optimizers.append(shard_optimizer)
        # The user's kernel choices, reported in state_dict() whatever kernels the shards use.
        self._user_flags = {k: template.defaults[k] for k in KERNEL_KEYS if k in template.defaults}
        if template.state:
            self.load_state_dict(template.state_dict())

    def updated_parameter_indices(self) -> list[int]:
        return list(self._order)  # its param_groups hold 1/N shards, not parameters

    def _primary(self) -> torch.optim.Optimizer:
        # The user's optimizer keeps the hyper-parameters (a scheduler built on it before distribute writes
        # there); its own state is not used: each shard's optimizer holds the state of its share.
        return self._template

    def _replica(self, action: str) -> int:
        replica = self._current_replica()
        if replica is None:
            if len(self._optimizers) == 1:
                return 0
            raise InputError(
                f"optimizer.{action}() ran outside strategy.run(): each replica updates its share of the parameters "
                "inside the step function. Call it in the function given to strategy.run()."
            )
        return replica

    @property
    def state(self) -> dict[nn.Parameter, dict[str, Any]]:  # type: ignore[override]
        """The whole state keyed by the parameters of replica 0 (built on demand)."""
        merged = self.state_dict()["state"]
        source = self._replica_params[0]
        return {source[self._order[i]]: entry for i, entry in merged.items()}

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        replica = self._replica("step")
        optimizer = self._sync_hyperparameters(replica)
        params = self._replica_params[replica]
        shards = [p for group in optimizer.param_groups for p in group["params"]]
        for shard, i, (lo, hi) in zip(shards, self._order, self._bounds[replica]):
            grad = params[i].grad
            shard.grad = None if grad is None else grad.reshape(-1)[lo:hi]
        result = traced_step(self._host, lambda: optimizer.step(closure))
        for shard in shards:
            shard.grad = None
        self._host.meet(replica, "optimizer step")  # nobody reads the parameters until every share is updated
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        replica = self._current_replica() or 0
        for p in self._replica_params[replica]:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    def state_dict(self) -> dict[str, Any]:
        # The hyper-parameters as the primary groups hold them now (a scheduler may have stepped since the
        # last optimizer step).
        _copy_hyperparameters(self._template.param_groups, self._optimizers[0].param_groups)
        dicts = [opt.state_dict() for opt in self._optimizers]
        source = self._replica_params[0]
        merged: dict[int, dict[str, Any]] = {}
        for i in dicts[0]["state"]:
            param = source[self._order[i]]
            entry: dict[str, Any] = {}
            for key, value in dicts[0]["state"][i].items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    parts = [d["state"][i][key].reshape(-1) for d in dicts]
                    entry[key] = torch.cat(parts).view_as(param).clone()
                else:
                    entry[key] = value
            merged[i] = entry
        groups = [{**group, **self._user_flags} for group in dicts[0]["param_groups"]]  # the user's kernel flags
        return {"state": merged, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        source = self._replica_params[0]
        for r, optimizer in enumerate(self._optimizers):
            shard_state: dict[int, dict[str, Any]] = {}
            for i, entry in state_dict["state"].items():
                i = int(i)
                numel = source[self._order[i]].numel()
                lo, hi = self._bounds[r][i]
                shard_state[i] = {key: _shard_of(value, numel, lo, hi) for key, value in entry.items()}
            flags = [{k: g[k] for k in KERNEL_KEYS if k in g} for g in optimizer.param_groups]
            groups = [{**group, **mine} for group, mine in zip(state_dict["param_groups"], flags)]
            optimizer.load_state_dict({"state": shard_state, "param_groups": groups})
        # The primary groups hold the hyper-parameters: they take the loaded ones too.
        _copy_hyperparameters(self._optimizers[0].param_groups, self._template.param_groups)


def _shard_of(value: Any, numel: int, lo: int, hi: int) -> Any:
    """A shard's own copy of one state entry: its slice of a per-element tensor, a clone of any other
    tensor. Scalar tensors (Adam's `step`) must not be shared: torch's load_state_dict keeps a tensor
    that is already of the right dtype and device, and every shard would then count each step."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() > 0 and value.numel() == numel:
        return value.reshape(-1)[lo:hi].clone()
    return value.clone()


def _prefer_fast_kernels(optimizer: torch.optim.Optimizer) -> None:
    """Gives a shard's optimizer torch's fastest kernels for the same arithmetic, where the user left the
    choice to torch: fused (one pass over parameter, gradient and state; about 5% of a step on the MLP
    workload with two CPU replicas), else foreach. torch picks neither on a CPU by default. Only for torch's
    own classes (a subclass may not take the flags), not for ASGD, whose foreach kernel rounds differently
    from its single-tensor one (1.5e-9 apart in float64 after six steps of a small MLP), so the shards
    would drift from the one-device result."""
    defaults = optimizer.defaults
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS or type(optimizer) is torch.optim.ASGD:
        return
    if defaults.get("foreach") is not None or defaults.get("fused") or defaults.get("differentiable"):
        return
    if "fused" in defaults and type(optimizer) in _FUSED_ON_CPU:
        flags = {"fused": True, "foreach": None}
        # Written on stratagem's own copy (a shard's optimizer, made by clone_optimizer), never on the user's
        # optimizer. What the class's __init__ does for fused=True in torch 2.13 (Adam, AdamW, SGD, Adagrad):
        # GradScaler hands the scale to an optimizer whose _step_supports_amp_scaling is true, and the fused
        # kernel checks the parameters' device and dtype at the first step when _need_device_dtype_check_for_fused
        # is; the copy was made with the user's flags, so it lacks them. Undeclared on Optimizer in torch's stubs.
        optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]
        optimizer._need_device_dtype_check_for_fused = True  # type: ignore[attr-defined]
    elif "foreach" in defaults:
        flags = {"foreach": True}
    else:
        return
    for target in [defaults, *optimizer.param_groups]:
        target.update({k: v for k, v in flags.items() if k in target or k in defaults})


_FUSED_ON_CPU: frozenset[type[torch.optim.Optimizer]] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adagrad,
    }
)
"""torch's optimizers with a fused kernel for CPU tensors (torch 2.13)."""
