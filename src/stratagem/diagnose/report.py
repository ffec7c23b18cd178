"""The ``stratagem doctor`` report as data, and the rule that turns it into an exit code.

The rule: the doctor exits non-zero when a check's verdict is ``problem`` (a GPU the machine has
cannot be used, or what was asked for cannot run; see `stratagem.diagnose.checks`) or when a
smoke-test step fails. Warnings never block: a CPU-only build on a machine without a GPU trains
fine on the CPU. A smoke-test step that was skipped is reported, not counted as a failure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from stratagem.diagnose.decisions import PlacementDecision
from stratagem.diagnose.facts import EnvironmentFacts
from stratagem.diagnose.verdict import Check


@dataclasses.dataclass(frozen=True, kw_only=True)
class SmokeResult:
    """One step of the doctor's smoke test."""

    name: str
    """``"all-reduce"``, ``"training step on cpu:0"``, ..."""
    passed: bool | None
    """``None`` when the step was skipped; ``detail`` says why."""
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(kw_only=True)
class DoctorReport:
    """Everything ``stratagem doctor`` found, renderable as text (by the CLI) or JSON."""

    facts: EnvironmentFacts
    checks: list[Check]
    devices: list[str]
    """What ``MirroredStrategy()`` would use here."""
    decision: PlacementDecision
    smoke: list[SmokeResult] = dataclasses.field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return exit_code(self.checks, self.smoke)

    def to_dict(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "blocking": [check.name for check in blocking_checks(self.checks)],
            "checks": [check.to_dict() for check in self.checks],
            "mirrored_strategy": {"devices": self.devices, "decision": self.decision.to_dict()},
            "smoke_test": [step.to_dict() for step in self.smoke],
            "facts": self.facts.to_dict(),
        }


def blocking_checks(checks: Sequence[Check]) -> list[Check]:
    """The checks that block training: those whose verdict is ``problem``."""
    return [check for check in checks if check.verdict == "problem"]


def exit_code(checks: Sequence[Check], smoke: Sequence[SmokeResult] = ()) -> int:
    """0 when nothing blocks training, 1 when a check is a problem or a smoke-test step failed.

    Example:
        >>> exit_code([Check(name="torch_build", verdict="warning", reason="CPU-only build")])
        0
    """
    failed = any(step.passed is False for step in smoke)
    return 1 if blocking_checks(checks) or failed else 0
