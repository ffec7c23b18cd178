"""The model and optimizer that `Strategy.distribute` hands back.

They stand for one replica's model and optimizer: inside `Strategy.run` the replica whose
thread is running, outside it replica 0. So a training step written for one device (calling
`model(x)`, `model.parameters()`, `optimizer.step()`) runs unchanged on every replica.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from stratagem.errors import InputError
from stratagem.strategies.replicas import current_replica_context


def _replica_index(owner: Any) -> int:
    ctx = current_replica_context()
    if ctx is None or ctx.strategy is not owner._strategy:
        return 0
    return ctx.replica_id_in_sync_group


class DistributedModel(nn.Module):
    """One model replica per device, kept identical; calls go to the running replica's copy.

    Example:
        >>> model, optimizer = strategy.distribute(Net(), torch.optim.SGD(...))
        >>> model(x)            # inside strategy.run: this replica's copy, on this replica's device
        >>> model.state_dict()  # outside: replica 0's (every replica holds the same values)
    """

    def __init__(self, replicas: Sequence[nn.Module], strategy: Any) -> None:
        super().__init__()
        # Not registered as sub-modules: parameters() must list one replica's parameters, not all of them.
        object.__setattr__(self, "_replicas", list(replicas))
        object.__setattr__(self, "_strategy", strategy)

    @property
    def module(self) -> nn.Module:
        """The running replica's model (replica 0's outside `Strategy.run`)."""
        return self._replicas[_replica_index(self)]

    @property
    def replicas(self) -> list[nn.Module]:
        """Every replica's model, in replica order."""
        return list(self._replicas)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Through the strategy: a replica whose slice is empty calls the model on a stand-in (empty_slices.py).
        return self._strategy._call_replica(self.module, args, kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self.module.buffers(recurse)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(*args, **kwargs)

    def children(self) -> Iterator[nn.Module]:
        return self.module.children()

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        return self.module.named_children()

    def modules(self) -> Iterator[nn.Module]:
        return self.module.modules()

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        return self.module.named_modules(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        result = None
        for replica in self._replicas:
            result = replica.load_state_dict(state_dict, strict=strict, assign=assign)
        return result

    def train(self, mode: bool = True) -> "DistributedModel":
        for replica in self._replicas:
            replica.train(mode)
        object.__setattr__(self, "training", mode)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none)

    def to(self, *args: Any, **kwargs: Any) -> "DistributedModel":
        raise InputError(
            "A distributed model stays on the devices its strategy chose; it cannot be moved with .to(). "
            f"Received: .to({', '.join(map(repr, args))}). Choose devices with the strategy's `devices=` instead."
        )

    def __getattr__(self, name: str) -> Any:
        if name in ("_replicas", "_strategy"):
            raise AttributeError(name)
        return getattr(self.module, name)

    def __repr__(self) -> str:
        return f"DistributedModel(num_replicas={len(self._replicas)}, module={self._replicas[0]!r})"


class ReplicatedOptimizer(torch.optim.Optimizer):
    """What the optimizers `distribute` returns share: one optimizer per replica in `_optimizers`,
    replica 0's hyper-parameters copied to the others before each of their steps."""

    _optimizers: list[torch.optim.Optimizer]

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._optimizers[0].defaults

    def _sync_hyperparameters(self, replica: int) -> torch.optim.Optimizer:
        """Replica `replica`'s optimizer, with replica 0's hyper-parameters (an LR scheduler writes those)."""
        optimizer = self._optimizers[replica]
        if replica:
            for primary, mine in zip(self._optimizers[0].param_groups, optimizer.param_groups):
                for key, value in primary.items():
                    if key != "params":
                        mine[key] = value
        return optimizer

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise InputError(
            "Parameter groups cannot be added to an optimizer after it was distributed. "
            f"Received: a group with keys {sorted(param_group)}. Add every group before strategy.distribute()."
        )

    def __getstate__(self) -> dict[str, Any]:
        return self.state_dict()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_replicas={len(self._optimizers)}, optimizer={self._optimizers[0]!r})"


class DistributedOptimizer(ReplicatedOptimizer):
    """One optimizer per replica, each updating its own replica's parameters identically.

    Hyper-parameters set on it (an LR scheduler writing `param_groups[i]["lr"]`) are those of
    replica 0 and are copied to the other replicas before each of their steps.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], strategy: Any) -> None:
        # torch.optim.Optimizer.__init__ is not called: this object owns no parameters of its own.
        self._optimizers = list(optimizers)
        self._strategy = strategy

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The running replica's optimizer (replica 0's outside `Strategy.run`)."""
        return self._optimizers[_replica_index(self)]

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if current_replica_context() is None:
            raise InputError(
                "optimizer.step() ran outside strategy.run(), so only replica 0 would be updated and the replicas "
                "would drift apart. Call it in the function given to strategy.run()."
            )
        return self._sync_hyperparameters(_replica_index(self)).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizers[0].state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for optimizer in self._optimizers:
            optimizer.load_state_dict(state_dict)



def replicate_optimizer(
    optimizer: torch.optim.Optimizer, source_params: Sequence[nn.Parameter], params: Sequence[nn.Parameter]
) -> torch.optim.Optimizer:
    """A new optimizer of the same class and hyper-parameters over `params` (replica parameters in
    the order of `source_params`), carrying over any state `optimizer` already has."""
    index = {id(p): i for i, p in enumerate(source_params)}
    groups = []
    for group in optimizer.param_groups:
        copy = {k: v for k, v in group.items() if k != "params"}
        copy["params"] = [params[index[id(p)]] for p in group["params"]]
        groups.append(copy)
    try:
        replica = type(optimizer)(groups, **optimizer.defaults)
    except TypeError as error:
        raise InputError(
            f"Cannot build a copy of the optimizer for another replica: {type(optimizer).__name__}(params, "
            f"**defaults) failed with {error}. Received: defaults={optimizer.defaults}. An optimizer must accept "
            "its own `defaults` as keyword arguments to be replicated."
        ) from error
    if optimizer.state:
        replica.load_state_dict(optimizer.state_dict())
    return replica


def check_optimizer_matches(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raises `InputError` when the optimizer holds a tensor that is not a parameter of the model."""
    own = {id(p) for p in model.parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in own:
                raise InputError(
                    "The optimizer holds a tensor that is not a parameter of the model given to distribute(). "
                    f"Received: a tensor of shape {tuple(p.shape)} in param_groups[{g}]. Build the optimizer from "
                    "model.parameters() of the same model object you distribute."
                )
