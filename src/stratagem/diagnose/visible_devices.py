"""``CUDA_VISIBLE_DEVICES`` read the way CUDA reads it, as a pure function of its text and the driver's GPUs.

CUDA walks the comma-separated entries in order and keeps each valid one; at the first invalid entry
it stops, and the GPUs kept so far are all a process sees. An entry is a GPU index (below the
driver's count), or a GPU or MIG UUID (``GPU-...``, ``MIG-...``; a unique prefix of one the driver
lists is enough). Some values hide every GPU: an empty one, one starting with ``-1``, one that names
a GPU twice (``0,0``). CUDA 11 and 12 enumerate only one MIG device in a process (NVIDIA's MIG user
guide), so of several MIG UUIDs only the first is seen.

Example:
    >>> read_visible_devices("0,GPU-x", driver_count=2, uuids=None).visible
    ['0']
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisibleDevices:
    """What a ``CUDA_VISIBLE_DEVICES`` value leaves visible."""

    raw: str
    entries: tuple[str, ...]
    visible: list[str]
    """The entries CUDA keeps, in order (what torch numbers cuda:0, cuda:1, ...)."""
    invalid: str | None = None
    """The entry CUDA stopped at, if any."""
    why_invalid: str = ""
    hides_all: str | None = None
    """Why every GPU is hidden when the value as a whole does that (empty, ``-1``, a repeated GPU)."""
    on_purpose: bool = False
    """An empty value or a leading ``-1``: the usual ways to hide GPUs deliberately."""
    mig_ignored: tuple[str, ...] = ()
    """MIG entries after the first, which CUDA does not enumerate."""

    @property
    def count(self) -> int:
        return len(self.visible)


def read_visible_devices(raw: str, *, driver_count: int | None, uuids: Sequence[str] | None) -> VisibleDevices:
    """Reads ``raw`` as CUDA does; ``driver_count`` and ``uuids`` (the driver's GPU and MIG UUIDs) may be unknown."""
    entries = tuple(entry.strip() for entry in raw.split(","))
    if raw.strip() == "" or entries[0] == "-1":
        return VisibleDevices(raw=raw, entries=entries, visible=[], hides_all="it hides every GPU", on_purpose=True)
    visible: list[str] = []
    seen: dict[str, str] = {}  # what an entry resolves to (an index or a full UUID) -> the entry
    for entry in entries:
        target, why = _resolve(entry, driver_count, uuids)
        if target is None:
            return VisibleDevices(
                raw=raw,
                entries=entries,
                visible=visible,
                invalid=entry,
                why_invalid=why,
                mig_ignored=_mig_beyond_first(visible),
            )
        if target in seen:
            return VisibleDevices(
                raw=raw,
                entries=entries,
                visible=[],
                hides_all=f"{seen[target]!r} and {entry!r} name the same GPU, and CUDA then shows no GPU at all",
            )
        seen[target] = entry
        visible.append(entry)
    mig_ignored = _mig_beyond_first(visible)
    kept = [entry for entry in visible if entry not in mig_ignored]
    return VisibleDevices(raw=raw, entries=entries, visible=kept, mig_ignored=mig_ignored)


def _resolve(entry: str, driver_count: int | None, uuids: Sequence[str] | None) -> tuple[str | None, str]:
    """The GPU an entry names (its index, or the full UUID when the driver's are known), or None and why not."""
    if re.fullmatch(r"-?\d+", entry):
        index = int(entry)
        if index < 0:
            return None, "a negative index"
        if driver_count is not None and index >= driver_count:
            return None, f"index {index} is out of range: the driver reports {driver_count} GPU(s)"
        return str(index), ""
    kind = entry[:4]
    if kind in ("GPU-", "MIG-"):
        body = entry[4:]
        if not re.fullmatch(r"[0-9a-fA-F][0-9a-fA-F-]*", body):
            return None, f"not a {kind[:3]} UUID: a UUID is hexadecimal digits and dashes"
        if uuids is None:
            return entry.lower(), ""  # only the driver can tell whether it exists
        matches = [uuid for uuid in uuids if uuid.lower().startswith(entry.lower())]
        if not matches:
            listed = sum(uuid.startswith(kind) for uuid in uuids)
            return None, f"no {kind[:3]} device the driver lists has this UUID (it lists {listed})"
        if len(matches) > 1:
            return None, f"a prefix of {len(matches)} UUIDs, so it names no single device"
        return matches[0].lower(), ""
    return None, "not a GPU index or UUID"


def _mig_beyond_first(visible: Sequence[str]) -> tuple[str, ...]:
    migs = [entry for entry in visible if entry.startswith("MIG-")]
    return tuple(migs[1:])
