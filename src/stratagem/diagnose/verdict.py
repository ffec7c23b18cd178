"""`Check`, what every doctor check returns: a verdict with its reason and its fix.

Verdicts follow one rule, so ``stratagem doctor`` can turn them into an exit code:

* ``problem``: a GPU the machine has cannot be used, or what was asked for cannot run. Something is
  broken and training would not do what the user meant.
* ``warning``: training runs, but not the way a GPU user may expect.
* ``ok``: fine, or not applicable (the reason says which).

Example:
    >>> Check(name="nccl", verdict="warning", reason="NCCL is missing.", fix="Install it.").message
    'NCCL is missing. Install it.'
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

Verdict = Literal["ok", "warning", "problem"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Check:
    """The verdict of one diagnosis, with the reason and the fix, both naming the values seen."""

    name: str
    """What was checked (``torch_build``, ``driver``, ...), as ``stratagem doctor --json`` names it."""
    verdict: Verdict
    """``ok``, ``warning`` or ``problem`` (see the module docstring)."""
    reason: str
    """What was found, with the values seen."""
    fix: str = ""
    """What to do about it; empty when there is nothing to do."""

    @property
    def message(self) -> str:
        """Reason and fix in one sentence pair, for error messages."""
        return f"{self.reason} {self.fix}" if self.fix else self.reason

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
