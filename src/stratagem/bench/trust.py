"""Whether the figures of a `stratagem bench` run can be trusted.

A benchmark on a machine that other work keeps busy measures that work as much as the strategies:
threads wait for cores, and a configuration with more intra-op threads than free cores can slow down
tenfold while one with fewer does not, which then reads as an impossible speedup. Three signs are
checked, each giving a warning that says the figures are not to be trusted:

- the load average before the run, against the cores (other processes were running);
- the spread of a configuration's own runs (plain PyTorch runs first and last of every round, so even
  one round has two runs of it): the machine's speed changed during the run;
- a scaling efficiency above 1 (plus a margin for timing noise): N replicas did more than N times the
  work of one on N times the hardware, which the hardware cannot give; the one-replica run was slowed.

Example:
    >>> trust_warnings([], Load(one_minute=3.5, cores=2))[0][:36]
    'The machine was busy before the run:'
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

BUSY_LOAD_PER_CORE = 0.5
"""Load average per core, before the run, above which the machine counts as busy."""
SPREAD_LIMIT = 0.25
"""(max - min) / median of one configuration's runs above which its figures are not stable."""
EFFICIENCY_LIMIT = 1.1
"""Scaling efficiency above which the hardware cannot account for the speedup (1.0 plus timing noise)."""


@dataclass(frozen=True)
class Load:
    """The 1-minute load average and the cores it is to be read against."""

    one_minute: float
    cores: int

    def to_dict(self) -> dict[str, Any]:
        return {"load_average_1min": self.one_minute, "cores": self.cores}


def machine_load() -> Load | None:
    """This machine's load now; None where the platform has no load average."""
    try:
        one_minute = os.getloadavg()[0]
    except OSError:
        return None
    return Load(one_minute=float(one_minute), cores=os.cpu_count() or 1)


def trust_warnings(rows: Sequence[Any], load_before: Load | None) -> list[str]:
    """Why the figures of `rows` (measured `ScalingRow`s) are not to be trusted; empty when nothing says so."""
    warnings = []
    if load_before is not None and load_before.one_minute > BUSY_LOAD_PER_CORE * load_before.cores:
        warnings.append(
            f"The machine was busy before the run: load average {load_before.one_minute:.2f} on "
            f"{load_before.cores} core(s), so other processes competed for the cores. The figures are not to be "
            "trusted; run again on an idle machine."
        )
    for row in rows:
        runs = list(getattr(row, "samples_per_s_runs", []))
        if row.status == "ok" and len(runs) >= 2:
            spread = (max(runs) - min(runs)) / statistics.median(runs)
            if spread > SPREAD_LIMIT:
                shown = ", ".join(f"{run:,.0f}" for run in runs)
                warnings.append(
                    f"{row.workload} {row.label} ({row.kind}): its runs differ by {spread:.0%} (samples/s {shown}), "
                    "so the machine's speed changed during the run. The figures are not to be trusted."
                )
        efficiency = getattr(row, "scaling_efficiency", None)
        if efficiency is not None and efficiency > EFFICIENCY_LIMIT:
            warnings.append(
                f"{row.workload} {row.label} ({row.kind}): scaling efficiency {efficiency:.2f} is above what the "
                f"hardware allows (1.0: {row.replicas} replicas on {row.ideal_speedup} times the hardware of one), so "
                "its 1-replica run was slowed, by a busy machine or by more threads than free cores. The figures are "
                "not to be trusted."
            )
    return warnings
