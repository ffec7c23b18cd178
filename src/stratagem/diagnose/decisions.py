"""The record of one placement decision, so that nothing is decided silently.

Strategies collect these (which devices, which all-reduce, which backend) and print them
from ``explain()``; ``stratagem doctor`` prints the ones it would make on this machine.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacementDecision:
    """What was decided about one subject, and why.

    Example:
        >>> decision = PlacementDecision(subject="devices", choice="cpu:0",
        ...                              reason="torch 2.3.0+cpu is a CPU-only build")
        >>> decision.text()
        'devices: cpu:0 (torch 2.3.0+cpu is a CPU-only build)'
    """

    subject: str
    """What the decision is about: ``"devices"``, ``"all-reduce"``, ``"backend"``, ..."""
    choice: str
    """What was chosen, in words a user can search for: ``"cuda:0, cuda:1"``, ``"nccl"``."""
    reason: str
    """Why, naming the facts that decided it."""

    def text(self) -> str:
        return f"{self.subject}: {self.choice} ({self.reason})"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
