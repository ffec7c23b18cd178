"""What every GPU check script shares: run named checks, report each, and sum up for the exit code.

checks = Checks(sys.argv[1:])          # words: run only the checks whose name holds one
checks.run("one device on cuda:0", one_device)
return checks.summary("strategy")
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence


class Checks:
    """Runs each check (a function returning a detail string), printing PASS or FAIL with the traceback."""

    def __init__(self, only: Sequence[str] = ()) -> None:
        self.only = list(only)
        self.failed: list[str] = []

    def run(self, name: str, fn: Callable[[], str]) -> None:
        if self.only and not any(word in name for word in self.only):
            return
        start = time.perf_counter()
        try:
            detail = fn()
            print(f"[PASS] {name} ({time.perf_counter() - start:.1f}s): {detail}", flush=True)
        except Exception as error:  # noqa: BLE001 - a check script reports every failure
            self.failed.append(name)
            print(
                f"[FAIL] {name} ({time.perf_counter() - start:.1f}s): {type(error).__name__}: {error}\n"
                f"{traceback.format_exc(limit=6)}",
                flush=True,
            )

    def summary(self, kind: str) -> int:
        """Prints how many failed; the exit code (0 when all passed)."""
        print(f"{len(self.failed)} failed: {', '.join(self.failed)}" if self.failed else f"all {kind} checks passed")
        return 1 if self.failed else 0


def expect(condition: bool, what: str) -> None:
    """A check's assertion that `python -O` does not strip."""
    if not condition:
        raise AssertionError(what)
