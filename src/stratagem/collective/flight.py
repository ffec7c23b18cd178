"""A flight record of each worker's last collectives, and where the workers' records first differ.

Always on and cheap: each collective a `CrossWorker` starts appends one short list to a ring of the last
`KEPT` (its sequence number in this worker, op, what it carries, step, bytes, transport, start time on the wall
clock, state), and its end marks the entry done. When a collective fails or times out, every worker that can
still write dumps its ring to a JSON file (`dump`, in ``STRATAGEM_FLIGHT_DIR`` or the system's temporary
directory) and publishes it through the job's store; the error then compares the records that arrived
(`first_difference`): the first sequence number at which two workers entered different collectives, or which
one worker entered and another never reached, and who left no record at all (gone, or stuck where it cannot
answer).

Sequence numbers line up across workers because every worker of a synchronous strategy starts the same
collectives in the same order; the first place they do not is where the job went wrong. torch's own flight
recorder (``TORCH_FR_BUFFER_SIZE``) records the process group's collectives and not the shared-memory sums,
which most CPU jobs on one host use, nor what each carries, so this record is stratagem's.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stratagem import environ

KEPT = 64
"""Collectives kept per worker."""
FIELDS = ("seq", "op", "what", "step", "bytes", "transport", "start", "state")


class FlightRecord:
    """The last `kept` collectives of one worker."""

    def __init__(self, task_name: str, kept: int = KEPT) -> None:
        self.task_name = task_name
        self._entries: deque[list[Any]] = deque(maxlen=kept)
        self._seq = 0

    def enter(self, op: str, what: str, step: int, nbytes: int, transport: str) -> int:
        """A collective started now; its sequence number."""
        self._seq += 1
        self._entries.append([self._seq, op, what, step, nbytes, transport, time.time(), "entered"])
        return self._seq

    def done(self, seq: int) -> None:
        """The collective `seq` ended (it is among the last few: searched from the newest)."""
        for entry in reversed(self._entries):
            if entry[0] == seq:
                entry[7] = "done"
                return
            if entry[0] < seq:
                return

    def newest(self) -> dict[str, Any] | None:
        """The newest collective, as a dict of `FIELDS` (None before the first)."""
        return dict(zip(FIELDS, self._entries[-1])) if self._entries else None

    def entries(self) -> list[dict[str, Any]]:
        """The kept collectives, oldest first, as dicts of `FIELDS`."""
        return [dict(zip(FIELDS, entry)) for entry in self._entries]

    def dump(self, directory: str | Path | None = None) -> Path | None:
        """Writes the record to ``<directory>/flight-<task>-<pid>.json`` (default: `flight_dir()`); its path, or
        None when it cannot be written (a full or read-only disk must not hide the error being reported)."""
        folder = Path(directory) if directory is not None else flight_dir()
        name = self.task_name.replace(":", "-").replace("/", "-")
        path = folder / f"flight-{name}-{os.getpid()}.json"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"task": self.task_name, "pid": os.getpid(), "collectives": self.entries()}))
        except OSError:
            return None
        return path


def process_group_backend() -> str:
    """The default process group's backend, for a record's transport ("process group" where there is none)."""
    import torch.distributed as dist

    try:
        return str(dist.get_backend())
    except (RuntimeError, ValueError):
        return "process group"


def flight_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where flight records go: ``STRATAGEM_FLIGHT_DIR``, else ``<temporary directory>/stratagem-flight``."""
    return Path(environ.flight_dir(env) or Path(tempfile.gettempdir()) / "stratagem-flight")


def first_difference(records: Mapping[str, Sequence[Mapping[str, Any]] | None], newest_only: Sequence[str] = ()) -> str:
    """Where the workers' records (by task name, in rank order; None: no record arrived) first differ, in words.
    `newest_only`: the workers whose record is only their newest collective, as their pulse last reported it
    (they did not fail themselves: stuck, slow or gone)."""
    have = {name: {e["seq"]: e for e in entries} for name, entries in records.items() if entries is not None}
    silent = [name for name, entries in records.items() if entries is None]
    tail = f"; no record from {', '.join(silent)} (gone, or stuck where it cannot answer)" if silent else ""
    if newest_only:
        tail += f"; {', '.join(newest_only)}: the newest collective its pulse reported"
    if not have:
        return "no worker's record arrived" + tail
    first = max(min(seqs, default=0) for seqs in have.values())
    last = max(max(seqs, default=0) for seqs in have.values())
    for seq in range(max(first, 1), last + 1):
        entered = {name: seqs[seq] for name, seqs in have.items() if seq in seqs}
        signatures = {(e["op"], e["what"], e["step"]) for e in entered.values()}
        never = [name for name in have if name not in entered]
        if len(signatures) > 1:
            parts = [f"{name} entered {_describe(e)}" for name, e in entered.items()]
            return f"the workers diverge at collective #{seq}: " + ", ".join(parts) + tail
        if never:
            e = next(iter(entered.values()))
            lasts = ", ".join(f"{name} (its last: {_last(have[name])})" for name in never)
            return f"at collective #{seq} ({_describe(e)}) {', '.join(entered)} arrived and {lasts} never did" + tail
    newest = {name: _last(seqs) for name, seqs in have.items()}
    return f"the records that arrived agree up to #{last} ({'; '.join(f'{n}: {d}' for n, d in newest.items())})" + tail


def _describe(entry: Mapping[str, Any]) -> str:
    return f"{entry['what']} ({entry['op']}, step {entry['step']}, {entry['bytes']} bytes, {entry['state']})"


def _last(seqs: Mapping[int, Mapping[str, Any]]) -> str:
    if not seqs:
        return "none"
    seq = max(seqs)
    return f"#{seq} {_describe(seqs[seq])}"
