"""The technique MultiWorkerMirroredStrategy applies to a model, over the one `data` axis of its worker group.

MultiWorkerMirroredStrategy is its record plus this table (`worker_group/techniques.py`: the machinery every
strategy of techniques shares), of one technique:

1. replication (`data`), `apply_replication`: the model handed to the strategy's replica set
   (`data_parallel/replica_set.ReplicaSet.distribute`), which places a replica on each local device
   (`MirroredReplicas`) and prepares the parts that keep them equal: the local combination, then the gradients
   summed across workers inside backward, each replica weighted by its share of the global batch
   (`multi_worker/across.AcrossWorkers`), so that the result is one device's.

Before it the strategy holds the memory plan against the process's limit and checks the arguments (`strategy.py`).

Example:
    >>> [(t.name, t.axes) for t in TECHNIQUES]
    [('replication', ('data',))]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stratagem.diagnose import PlacementDecision
from stratagem.strategies.data_parallel.replica_set import ReplicaSet
from stratagem.strategies.worker_group.techniques import ONE_DATA_AXIS, Technique, techniques_decision


@dataclass(kw_only=True)
class Replicating:
    """MultiWorkerMirroredStrategy's model as its technique leaves it."""

    model: nn.Module
    """The user's model."""
    optimizer: torch.optim.Optimizer | None
    """The user's optimizer, or None."""
    replicas: ReplicaSet
    """The strategy's replica set: its local devices and the parts of a step (strategy.py)."""
    distributed: Any = None
    """What the replica set returned: the distributed model, or ``(model, optimizer)``; set by the technique."""


def apply_replication(placing: Replicating) -> None:
    """A replica of the model on every local device, its gradients summed across the local replicas and the
    workers inside backward, weighted (the replica set's parts)."""
    placing.distributed = placing.replicas.distribute(placing.model, placing.optimizer)


TECHNIQUES: tuple[Technique[Replicating], ...] = (
    Technique(name="replication", axes=ONE_DATA_AXIS, apply=apply_replication),
)
"""What MultiWorkerMirroredStrategy applies, in order: its one technique."""


class TechniquesPart:
    """`explain()`'s `techniques` line, as a part of the strategy (`ReplicatedStrategy.explain` asks each part)."""

    def decisions(self) -> list[PlacementDecision]:
        return [
            techniques_decision(
                TECHNIQUES,
                ONE_DATA_AXIS,
                reason="MultiWorkerMirroredStrategy's techniques (multi_worker/techniques.py): a replica per local "
                "device, each gradient summed across the local replicas and then the workers inside backward, "
                "weighted by each replica's share of the global batch",
            )
        ]

    def details(self) -> dict[str, Any]:
        return {}
