"""The replica context: which replica the current thread runs, inside `Strategy.run` (tf.distribute's).

Every strategy that runs replicas sets it on each replica's thread (`enter_replica`), and what runs inside
a step reads it (`current_replica_context`): `sg.set_loss_weight`, the distributed optimizers, BatchNorm's
meetings, `gather`'s refusal inside a replica, the placement log. Beside it, what a replica sees of those
it runs with: the strategy (`ReplicaStrategy`), the meeting of one process's replicas (`ReplicaMeeting`,
which the schedulers of every strategy use) and where its loss weight goes (`LossWeightHost`). None of them
imports `base.py`, which imports this module.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from stratagem.diagnose.placement import note_replica

if TYPE_CHECKING:
    from stratagem.trace import Recorder
    from stratagem.values import ReduceOp


class ReplicaStrategy(Protocol):
    """The members of a strategy that the replica context, `step()` and the lockstep loop call: `Strategy` has
    them. Declared here rather than imported from `base.py`, which imports this module."""

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas take part in each step, across every worker."""

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """`fn` once per replica."""

    def reduce(self, op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Per-replica values combined into one."""

    def gather(self, value: Any, axis: int = 0) -> Any:
        """Every replica's values, in global batch order."""

    def distribute_dataset(self, dataset: Iterable[Any], shard: str = "auto", *, batch_dim: int = 0) -> Any:
        """Each global batch of `dataset` split among the replicas."""


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


_context = threading.local()


@dataclass(frozen=True)
class ReplicaContext:
    """Which replica the current thread runs, inside `Strategy.run` (tf.distribute's ReplicaContext)."""

    replica_id_in_sync_group: int
    num_replicas_in_sync: int
    device: torch.device
    strategy: ReplicaStrategy | None
    """The strategy that runs the replica (None: a `Pipeline` built on its own, outside any strategy)."""
    host: LossWeightHost | None = None
    """The host of the replicas (a data-parallel strategy's replica set, or ShardedStrategy), which
    `sg.set_loss_weight` tells the replica's loss weight; None where the strategy runs no replicas in lockstep
    (model parallelism)."""


def current_replica_context() -> ReplicaContext | None:
    """The replica context of this thread, or None outside `Strategy.run`."""
    return getattr(_context, "value", None)


def enter_replica(ctx: ReplicaContext | None) -> ReplicaContext | None:
    """Sets this thread's replica context; returns the previous one."""
    previous = getattr(_context, "value", None)
    _context.value = ctx
    if ctx is None:
        note_replica(None)
    else:
        note_replica(ctx.replica_id_in_sync_group, ctx.device)
    return previous
