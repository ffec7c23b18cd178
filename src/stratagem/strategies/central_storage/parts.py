"""The pieces CentralStorageStrategy hands out and combines with: the model and optimizer that
`distribute` returns, and the reduction of gradients onto the central device.

The model stands for the running replica's compute copy inside `Strategy.run` (so the forward
pass, `backward()` and clipping work on that replica's device) and for the central copy outside
it (so `state_dict()`, evaluation and checkpoints read the one copy that is trained). The
optimizer is a thin front for the user's own optimizer, which holds the central parameters: every
replica calls `step()`, the strategy applies it once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from stratagem.collective.local import Grads
from stratagem.strategies.data_parallel.distributed import DistributedModel, ReplicatedOptimizer, positions
from stratagem.strategies.data_parallel.host import ReplicaHost


@dataclass(frozen=True)
class CentralCopy:
    """One distributed model under central storage: its central copy and every replica's compute copy."""

    central: nn.Module
    central_params: list[nn.Parameter]
    """The central copy's trainable parameters, in the order of `parameters()`."""
    replicas: list[nn.Module]
    first: int
    """Where its trainable parameters start in each replica's list (`ReplicaHost.replica_params`): the
    models distributed before it come first."""


class CentralSteps(Protocol):
    """What the model and optimizer handed out ask of the strategy's update (`update.CentralUpdate` is it;
    declared here because update.py imports this module)."""

    def refresh_replicas(self) -> None:
        """Hands every replica the current central parameters and buffers."""

    def apply_update(self, optimizer: torch.optim.Optimizer, held: CentralCopy, closure: Any) -> Any:
        """`optimizer.step()` over the model `held`, applied once."""

    def zero_grad(self, held: CentralCopy, set_to_none: bool) -> None:
        """The gradients of the model `held`, zeroed."""


class CentralModel(DistributedModel):
    """The model `CentralStorageStrategy.distribute` returns.

    Inside `strategy.run` it is the running replica's compute copy; outside, the central copy,
    which holds the parameters that are trained (`state_dict()`, `parameters()`, evaluation).

    Example:
        >>> model, optimizer = strategy.distribute(Net(), torch.optim.Adam(net.parameters()))
        >>> model(x)                 # inside strategy.run: this replica's copy, on its device
        >>> model.state_dict()       # outside: the central copy (the parameters, once)
    """

    def __init__(self, held: CentralCopy, host: ReplicaHost, update: CentralSteps) -> None:
        # Not registered as a sub-module (nn.Module's __setattr__ would): parameters() lists one copy's parameters.
        object.__setattr__(self, "_central", held.central)
        object.__setattr__(self, "_held", held)
        object.__setattr__(self, "_update", update)
        super().__init__(held.replicas, host)

    @property
    def module(self) -> nn.Module:
        """The running replica's compute copy inside `strategy.run`, the central copy outside it."""
        replica = self._host.current_replica()
        return self._central if replica is None else self._replicas[replica]

    @property
    def central(self) -> nn.Module:
        """The copy on the central device: the parameters the optimizer updates."""
        return self._central

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        result = self._central.load_state_dict(state_dict, strict=strict, assign=assign)
        self._update.refresh_replicas()
        return result

    def train(self, mode: bool = True) -> CentralModel:
        self._central.train(mode)
        super().train(mode)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._update.zero_grad(self._held, set_to_none)

    def __getattr__(self, name: str) -> Any:
        if name in ("_central", "_held", "_update"):
            raise AttributeError(name)
        return super().__getattr__(name)

    def __repr__(self) -> str:
        return f"CentralModel(num_replicas={len(self._replicas)}, module={self._central!r})"


class CentralOptimizer(ReplicatedOptimizer):
    """The optimizer `CentralStorageStrategy.distribute` returns: the user's optimizer, applied once.

    `param_groups`, `state` and `state_dict()` are the user's optimizer's (one state per central
    parameter, on the central device; checkpoints in its own format). `step()` is called by every
    replica inside `strategy.run`; the update happens once, on the central device.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, held: CentralCopy, update: CentralSteps, host: ReplicaHost
    ) -> None:
        # torch.optim.Optimizer.__init__ is not called: the user's optimizer owns the parameters.
        self._optimizers = [optimizer]
        self._held = held
        self._update = update
        self._host = host
        self._central_params = held.central_params  # in the order of the central model's parameters
        self._start_watch()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The user's optimizer, over the central parameters."""
        return self._optimizers[0]

    def _replica_optimizer(self, replica: int) -> torch.optim.Optimizer:
        return self._optimizers[0]  # one optimizer for every replica

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self._stepped = True
        return self._update.apply_update(self.optimizer, self._held, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._update.zero_grad(self._held, set_to_none)

    def updated_parameter_indices(self) -> list[int]:
        # Its groups hold the central copy; the positions count on from the models distributed before it.
        return [self._held.first + i for i in positions(self._central_params, self.optimizer.param_groups)]

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"CentralOptimizer(optimizer={self.optimizer!r})"


class ReduceToCentralDevice:
    """Sums the replicas' pre-scaled gradients on the central device, then copies the sum back into
    every replica's gradient (so clipping and logging in the step function see the global gradient).

    `anchor` is the replica whose gradients are the central parameters' own (it computes on the
    central device and shares its parameters); without one the sum is formed in a fresh buffer.
    One thread does the work while the others wait at the barrier that follows.
    """

    name = "reduction onto the central device (weighted gradients summed there, the sum copied back)"
    prescale = True

    def __init__(self, central: torch.device, anchor: int | None) -> None:
        self.central = central
        self.anchor = anchor

    def combine_(self, replica: int, grads: Grads, weights: Sequence[float]) -> None:
        if replica != 0:
            return
        num_replicas = len(grads)
        if self.anchor is not None:
            total = list(grads[self.anchor])
            others = [k for k in range(num_replicas) if k != self.anchor]
        else:
            total = [g.to(self.central, copy=True) for g in grads[0]]
            others = list(range(1, num_replicas))
        for k in others:
            torch._foreach_add_(total, [g.to(self.central) for g in grads[k]])
        for k in range(num_replicas):
            if k != self.anchor:
                torch._foreach_copy_(list(grads[k]), total)
