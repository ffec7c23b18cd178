"""The short report of a placement log: operations per device, copies per step, and the
operations that ran off their replica's device (what TF's log_device_placement buried in a flood)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from stratagem.diagnose.memory import format_bytes

OpKey = tuple[str, str, "int | None"]  # (op, device it ran on, replica or None)
CopyKey = tuple[str, str, "str | None"]  # (source, destination, reason or None)
OffKey = tuple[str, str, str, "str | None"]  # (op, device it ran on, the replica's device, reason or None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CopySummary:
    """Copies from one device to another (for one reason)."""

    source: str
    destination: str
    count: int
    num_bytes: int
    """Bytes moved: the elements of each copied tensor times their size."""
    reason: str | None = None
    """Why they were made when stratagem made them (``"soft placement"``); None for the program's own."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffDeviceOp:
    """An operation that ran on a device other than its replica's, and how often."""

    op: str
    device: str
    """Where it ran."""
    replica_device: str
    """Where its replica (or the log's `device=`) is."""
    count: int
    reason: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacementSummary:
    """What a placement log saw, short enough to read.

    ``str(summary)`` is the text report, ``summary.to_dict()`` the same as plain JSON-able data.

    Example:
        >>> with sg.log_placement() as log:
        ...     strategy.run(train_step, args=(x, y))
        >>> print(log.summary())
        Placement log: 1 step, 412 operations
        ...
    """

    steps: int
    """Steps seen (each `strategy.run`, or each `log.step()`); 0 when the code had none."""
    num_operations: int
    operations_per_device: dict[str, int]
    operations_per_replica: dict[str, int]
    """``"replica 0"``, ``"replica 1"``, ... and ``"no replica"`` for operations outside `strategy.run`."""
    copies: list[CopySummary]
    num_copies: int
    copy_bytes: int
    off_device: list[OffDeviceOp]
    """The most frequent operations that ran off their replica's device, at most `top` of them."""
    num_off_device: int
    """Every operation that ran off its replica's device (not only the ones listed)."""
    num_off_device_kinds: int
    """Distinct (operation, device, replica device, reason) rows, listed or not."""
    top: int

    @property
    def copies_per_step(self) -> float | None:
        return self.num_copies / self.steps if self.steps else None

    @property
    def bytes_per_step(self) -> float | None:
        return self.copy_bytes / self.steps if self.steps else None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["copies_per_step"] = self.copies_per_step
        data["bytes_per_step"] = self.bytes_per_step
        return data

    def __str__(self) -> str:
        if self.num_operations == 0 and self.num_copies == 0:
            return "Placement log: no operations recorded."
        steps = f"{self.steps} step{'s' if self.steps != 1 else ''}" if self.steps else "no steps marked"
        lines = [f"Placement log: {steps}, {self.num_operations:,} operations"]
        lines.append("Operations per device: " + _counts(self.operations_per_device))
        if len(self.operations_per_replica) > 1 or "no replica" not in self.operations_per_replica:
            lines.append("Operations per replica: " + _counts(self.operations_per_replica))
        if self.num_copies:
            per_step = ""
            if self.steps:
                per_step = (
                    f" ({self.copies_per_step:g} per step, {format_bytes(round(self.bytes_per_step or 0))} per step)"
                )
            lines.append(f"Copies between devices: {self.num_copies:,}, {format_bytes(self.copy_bytes)}{per_step}")
            for copy in self.copies:
                why = f" ({copy.reason})" if copy.reason else ""
                lines.append(
                    f"  {copy.source} -> {copy.destination}: {copy.count:,} cop{'ies' if copy.count != 1 else 'y'}, "
                    f"{format_bytes(copy.num_bytes)}{why}"
                )
        else:
            lines.append("Copies between devices: none")
        if self.num_off_device:
            shown = f"top {len(self.off_device)}" if len(self.off_device) < self.num_off_device_kinds else "all"
            lines.append(f"Operations off their replica's device: {self.num_off_device:,} ({shown})")
            width = max(len(op.op) for op in self.off_device)
            for op in self.off_device:
                why = f" ({op.reason})" if op.reason else ""
                lines.append(
                    f"  {op.op.ljust(width)}  x{op.count:<6,} ran on {op.device} instead of {op.replica_device}{why}"
                )
        else:
            lines.append("Operations off their replica's device: none")
        return "\n".join(lines)


def summarize(
    ops: Counter[OpKey],
    copies: Counter[CopyKey],
    copy_bytes: Counter[CopyKey],
    off_device: Counter[OffKey],
    steps: int,
    top: int,
) -> PlacementSummary:
    """Builds the report from a log's counters (see `PlacementLog`)."""
    per_device: Counter[str] = Counter()
    per_replica: Counter[str] = Counter()
    for (_, device, replica), n in ops.items():
        per_device[device] += n
        per_replica["no replica" if replica is None else f"replica {replica}"] += n
    copy_rows = [
        CopySummary(source=s, destination=d, count=n, num_bytes=copy_bytes[s, d, r], reason=r)
        for (s, d, r), n in copies.items()
    ]
    copy_rows.sort(key=lambda c: (-c.num_bytes, c.source, c.destination, c.reason or ""))
    off_rows = [
        OffDeviceOp(op=op, device=d, replica_device=e, count=n, reason=r) for (op, d, e, r), n in off_device.items()
    ]
    off_rows.sort(key=lambda o: (-o.count, o.op, o.device, o.reason or ""))
    return PlacementSummary(
        steps=steps,
        num_operations=sum(ops.values()),
        operations_per_device=dict(sorted(per_device.items())),
        operations_per_replica=dict(sorted(per_replica.items(), key=lambda kv: _replica_order(kv[0]))),
        copies=copy_rows,
        num_copies=sum(copies.values()),
        copy_bytes=sum(copy_bytes.values()),
        off_device=off_rows[:top],
        num_off_device=sum(off_device.values()),
        top=top,
        num_off_device_kinds=len(off_rows),
    )


def _replica_order(label: str) -> tuple[int, int]:
    if label == "no replica":
        return (1, 0)
    return (0, int(label.split()[1]))


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{key} {n:,}" for key, n in counts.items())
