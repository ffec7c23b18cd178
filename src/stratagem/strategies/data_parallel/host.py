"""What a replica host offers the parts that run inside its replicas: the declared protocol between them.

A *replica host* runs one process's replicas of a data-parallel strategy in lockstep (`ReplicaSet` is
the one there is). What `distribute` hands back and what the user calls inside `Strategy.run` (the
distributed model, the optimizers, the loss scaler, `sg.set_loss_weight`, the central-storage update)
runs on some replica's thread and asks its host which replica that is, meets the other local
replicas, or declares something about the step. They ask through these members and no others, as
`torch.distributed.algorithms.join` declares what a `Joinable` offers its `Join` context.

- `ReplicaMeeting` (`strategies/replica_context.py`, beside the replica context, since the schedulers of every
  strategy use it): which replica is running, and where the local replicas wait for each other. The
  optimizers and the central-storage update need nothing more.
- `ReplicaHost`: a meeting, and the strategy it serves, its replicas' parameters, the call of the
  running replica's model and the loss weight a step declares.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

from torch import nn

from stratagem.strategies.replica_context import LossWeightHost, ReplicaMeeting

if TYPE_CHECKING:
    from stratagem.strategies.base import Strategy


class ReplicaHost(ReplicaMeeting, LossWeightHost):
    """What the parts inside replicas may call on the host of one process's replicas (see the module)."""

    @property
    @abc.abstractmethod
    def strategy(self) -> Strategy:
        """The strategy these replicas belong to (what `ReplicaContext.strategy` names inside its run)."""

    @property
    @abc.abstractmethod
    def num_local_replicas(self) -> int:
        """How many replicas of this process run each step, each on its own thread."""

    @property
    @abc.abstractmethod
    def replica_params(self) -> list[list[nn.Parameter]]:
        """Each local replica's trainable parameters, in the order of `model.parameters()` (empty before
        `distribute`). After backward each holds the gradient combined over every replica in sync."""

    @abc.abstractmethod
    def call_replica(self, model: nn.Module, args: tuple, kwargs: dict) -> Any:
        """`model(*args, **kwargs)` for the running replica: on a stand-in input when its slice of the
        batch is empty, so that the replica still joins every meeting of the step."""
