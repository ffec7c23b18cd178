"""What a replica host offers the parts that run inside its replicas: the declared protocol between them.

A *replica host* runs one process's replicas of a data-parallel strategy in lockstep (`ReplicaSet` is
the one there is). What `distribute` hands back and what the user calls inside `Strategy.run` (the
distributed model, the optimizers, the loss scaler, `sg.set_loss_weight`, the central-storage update)
runs on some replica's thread and asks its host which replica that is, meets the other local
replicas, or declares something about the step. They ask through these members and no others, as
`torch.distributed.algorithms.join` declares what a `Joinable` offers its `Join` context.

- `ReplicaMeeting`: which replica is running, and where the local replicas wait for each other. The
  optimizers and the central-storage update need nothing more.
- `ReplicaHost`: a meeting, and the strategy it serves, its replicas' parameters, the call of the
  running replica's model and the loss weight a step declares.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from stratagem.strategies.base import Strategy
    from stratagem.trace import Recorder


class ReplicaMeeting(abc.ABC):
    """Which replica the calling thread runs, and the meeting of one process's replicas inside a step."""

    @abc.abstractmethod
    def current_replica(self) -> int | None:
        """The index of the local replica whose step runs on this thread; None outside `Strategy.run` (or
        inside another strategy's run)."""

    @property
    def recorder(self) -> Recorder | None:
        """The trace recorder of this process's steps (`stratagem.trace`), or None: nothing is traced."""
        return None

    @abc.abstractmethod
    def meet(self, replica: int, what: str) -> None:
        """Inside a step, `replica` waits until every local replica has reached `what` (an optimizer or a
        scheduler step, say); outside a step it returns at once. `what` names the meeting in the error
        raised when a replica does not arrive in time."""


class LossWeightHost(abc.ABC):
    """Where `sg.set_loss_weight` sends the weight of the running replica's loss: a replica set, or a strategy
    whose library combines the gradients itself (ShardedStrategy weights its reduce-scatter)."""

    @abc.abstractmethod
    def declare_loss_weight(self, replica: int, count: float) -> None:
        """`sg.set_loss_weight(count)` on `replica`: its gradient is weighted by `count` instead of its share
        of the batch, and the combined gradient divided by the sum of the counts over every replica."""


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
