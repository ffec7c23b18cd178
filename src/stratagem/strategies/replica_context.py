"""The replica context: which replica the current thread runs, inside `Strategy.run` (tf.distribute's).

Every strategy that runs replicas sets it on each replica's thread (`enter_replica`), and what runs inside
a step reads it (`current_replica_context`): `sg.set_loss_weight`, the distributed optimizers, BatchNorm's
meetings, `gather`'s refusal inside a replica, the placement log.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from stratagem.diagnose.placement import note_replica

if TYPE_CHECKING:
    from stratagem.strategies.base import Strategy
    from stratagem.strategies.data_parallel.host import LossWeightHost

_context = threading.local()


@dataclass(frozen=True)
class ReplicaContext:
    """Which replica the current thread runs, inside `Strategy.run` (tf.distribute's ReplicaContext)."""

    replica_id_in_sync_group: int
    num_replicas_in_sync: int
    device: torch.device
    strategy: Strategy | None
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
