"""`Strategy.explain()`: where a strategy runs and why, as data with a text and a JSON rendering."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from stratagem.diagnose import PlacementDecision


@dataclass(frozen=True)
class ReplicaPlacement:
    replica: int
    device: str
    """The logical device, e.g. "cpu:1" or "cuda:0"."""
    physical: str
    """The torch device the work really runs on, e.g. "cpu" or "cuda:0"."""


@dataclass(frozen=True)
class Explanation:
    """A report of a strategy's placement: replicas, devices, and the reason for each decision."""

    strategy: str
    num_replicas_in_sync: int
    replicas: list[ReplicaPlacement]
    decisions: list[PlacementDecision] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def decision(self, subject: str) -> PlacementDecision | None:
        """The decision recorded for `subject` (e.g. "devices", "gradient combination"), if any."""
        return next((d for d in self.decisions if d.subject == subject), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        updates = self.decision("updates")
        if updates is not None and updates.choice == "asynchronous":
            # A parameter-server job: no replicas step together (num_replicas_in_sync is 1, as in tf.distribute).
            lines = [f"{self.strategy}: asynchronous updates, no replicas in sync"]
        else:
            lines = [f"{self.strategy}: {self.num_replicas_in_sync} replica(s) in sync"]
        for r in self.replicas:
            lines.append(f"  replica {r.replica}: {r.device} (runs on {r.physical})")
        for d in self.decisions:
            lines.append(f"  {d.subject}: {d.choice} - {d.reason}")
        for key, value in self.details.items():
            lines.append(f"  {key}: {value}")
        return "\n".join(lines)
