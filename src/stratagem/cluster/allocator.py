"""Host memory of training processes: glibc keeps freed blocks for reuse instead of giving them back.

A training step frees and allocates the same large buffers every step (activations, gradients).
With glibc's defaults, a freed block that leaves more than the trim threshold free at the top of
the heap goes back to the system, and a block above the mmap threshold is unmapped when freed; the
next step faults the memory in again, page by page. On the 2-vCPU machine of
benchmarks/reports/2026-12-01-cpu-2vcpu-e.md that was 1,660-3,280 page faults a step for plain
PyTorch's CNN loop (one rank's half of the batch, one thread) and 13-34 with the two thresholds
below; the step took 66-76 ms instead of 72-95 ms (four pairs of runs).

The process then keeps its peak heap for reuse instead of returning it between steps, which is
what a training process wants. ``stratagem launch`` gives its tasks these settings, as torch's
CPU launcher (``torch.backends.xeon.run_cpu``) preloads a caching allocator, and ``stratagem
train`` applies them to its own process; a user's own process is left alone. A setting the user
made to when memory goes back to the system (the trim or mmap threshold, top pad or mmap count, in
``GLIBC_TUNABLES`` or glibc's older ``MALLOC_*_`` variables) always wins; other malloc tunables
(arenas, tcache) are kept alongside ours.

Where the kernel gives transparent huge pages only to memory that asks for them (``madvise``, the usual setting)
and glibc is 2.35 or newer, the tasks also get ``glibc.malloc.hugetlb=1``: glibc then asks for huge pages for each
block it maps (2 MiB and more) and for its heap, so a step that maps its large buffers afresh faults them in 2 MiB
at a time instead of 4 KiB. On the 12.6M-parameter MLP of benchmarks/sharded.py at 2 workers (this project's
2-vCPU machine) that raised MultiWorkerMirroredStrategy from 453 to 676 samples/s and ShardedStrategy's stage 2
from 348 to 570, with the same peak resident set (benchmarks/reports/2026-12-08-cpu-2vcpu-huge-pages.md). A user's
own ``glibc.malloc.hugetlb`` wins; ``--default-allocator`` gives neither.

    >>> keep_freed_memory_env({}, glibc=(2, 36), thp="never")
    {'GLIBC_TUNABLES': 'glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_threshold=33554432'}
    >>> keep_freed_memory_env({"MALLOC_TRIM_THRESHOLD_": "0"}, glibc=(2, 36), thp="madvise")
    {'GLIBC_TUNABLES': 'glibc.malloc.hugetlb=1'}
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Mapping
from pathlib import Path

TRIM_THRESHOLD = 1 << 30
"""Free memory at the top of the heap is returned to the system only beyond 1 GiB."""
MMAP_THRESHOLD = 32 << 20
"""Blocks up to 32 MiB come from the heap, not from mmap (glibc's ceiling for its own sliding threshold
on 64-bit hosts); larger ones are still mapped and unmapped one by one."""

_TUNABLES = (f"glibc.malloc.trim_threshold={TRIM_THRESHOLD}", f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}")
_OURS = ":".join(_TUNABLES)
KEEP_TUNABLES = _OURS
"""The GLIBC_TUNABLES value that keeps freed memory for reuse (what ``stratagem launch`` gives its tasks)."""
# The settings of when freed memory goes back to the system, as tunables and in glibc's older spelling
# (still read by glibc 2.36); a user who set one of them has chosen.
_RELEASE_TUNABLES = (
    "glibc.malloc.trim_threshold",
    "glibc.malloc.mmap_threshold",
    "glibc.malloc.top_pad",
    "glibc.malloc.mmap_max",
)
_LEGACY_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
# mallopt(3) parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MAP_LARGE_THRESHOLD = 64 << 10
"""Under ShardedStrategy, blocks of 64 KiB and more are mapped on their own and unmapped when freed
(``map_large_blocks_here``): sharding frees and allocates whole units, shards and gradients of different
sizes, and glibc's heap keeps every freed block for a later one that fits, so with the launcher's
thresholds a rank's resident set grew to twice what its tensors held (benchmarks/reports/
2026-12-07-cpu-2vcpu-sharded-memory.md); mapped blocks make the resident set follow the live tensors."""

_TUNABLES_SINCE = (2, 26)  # the first glibc that reads GLIBC_TUNABLES
HUGE_PAGES = "glibc.malloc.hugetlb=1"
"""The tunable that makes glibc's malloc madvise(MADV_HUGEPAGE) the blocks it maps and its heap."""
_HUGE_PAGES_SINCE = (2, 35)  # the first glibc with glibc.malloc.hugetlb
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_applied_here = False


def glibc_version() -> tuple[int, int] | None:
    """This process's glibc as (major, minor), or None under another C library (musl, macOS, Windows)."""
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.36"
    except (AttributeError, ValueError, OSError):
        return None
    found = re.fullmatch(r"glibc (\d+)\.(\d+)\S*", text or "")
    return (int(found[1]), int(found[2])) if found else None


GLIBC = glibc_version()
READS_TUNABLES = GLIBC is not None and GLIBC >= _TUNABLES_SINCE
"""Whether this process's C library reads ``GLIBC_TUNABLES`` (so the tasks ``stratagem launch`` starts keep
freed memory)."""


def transparent_huge_pages(path: Path = _THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``), None where it cannot be read."""
    try:
        found = re.search(r"\[(\w+)\]", path.read_text())
    except OSError:
        return None
    return found[1] if found else None


THP = transparent_huge_pages()


def huge_pages_env(env: Mapping[str, str], *, glibc: tuple[int, int] | None = GLIBC, thp: str | None = THP) -> bool:
    """Whether a new process started with ``env`` should get ``HUGE_PAGES``: glibc 2.35 or newer, a kernel that gives
    huge pages to memory that asks (``madvise``; under ``always`` every block has them already, under ``never``
    none can), and no ``glibc.malloc.hugetlb`` of the user's."""
    if glibc is None or glibc < _HUGE_PAGES_SINCE or thp != "madvise":
        return False
    return not any(item.split("=")[0] == "glibc.malloc.hugetlb" for item in env.get("GLIBC_TUNABLES", "").split(":"))


def user_setting(env: Mapping[str, str], *, glibc: tuple[int, int] | None = GLIBC) -> str | None:
    """The setting of when freed memory goes back to the system that ``env`` makes, as text
    (``MALLOC_TRIM_THRESHOLD_=0``), or ``None``. ``GLIBC_TUNABLES`` counts only for a glibc that reads it."""
    made = [f"{name}={env[name]}" for name in _LEGACY_VARIABLES if name in env]
    if glibc is not None and glibc >= _TUNABLES_SINCE:
        made += [item for item in env.get("GLIBC_TUNABLES", "").split(":") if item.split("=")[0] in _RELEASE_TUNABLES]
    return ", ".join(made) or None


def keep_freed_memory_env(
    env: Mapping[str, str], *, glibc: tuple[int, int] | None = GLIBC, thp: str | None = THP
) -> dict[str, str]:
    """The variables to add to ``env`` so that a new process keeps freed memory for reuse, with huge pages.

    The thresholds, unless there is no glibc that reads ``GLIBC_TUNABLES`` (``glibc``: this process's, which the
    tasks it starts share) or ``env`` already says when freed memory goes back to the system (``user_setting``);
    ``HUGE_PAGES`` where ``huge_pages_env`` says so (``thp``: the kernel's mode). Other tunables in
    ``GLIBC_TUNABLES`` are kept; ours are appended.
    """
    if glibc is None or glibc < _TUNABLES_SINCE:
        return {}
    ours = [] if user_setting(env, glibc=glibc) is not None else list(_TUNABLES)
    if huge_pages_env(env, glibc=glibc, thp=thp):
        ours.append(HUGE_PAGES)
    if not ours:
        return {}
    existing = env.get("GLIBC_TUNABLES")
    return {"GLIBC_TUNABLES": ":".join([existing, *ours] if existing else ours)}


def keep_freed_memory_here(env: Mapping[str, str]) -> bool:
    """Gives this process the same settings through ``mallopt(3)``; for a program that owns its process
    (``stratagem train``), never for a library call. Returns whether they were applied: not without glibc,
    not when ``env`` (this process's environment) has a ``user_setting``."""
    global _applied_here
    if GLIBC is None or user_setting(env) is not None:
        return False
    _applied_here = _mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) and _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    return _applied_here


def _mallopt(parameter: int, value: int) -> bool:
    """``mallopt(parameter, value)`` in this process; whether glibc took it (False where there is no mallopt)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(parameter, value) == 1)  # 1 on success


def _setting_besides_launchers(env: Mapping[str, str]) -> str | None:
    """`user_setting`, not counting the tunables ``stratagem launch`` itself gave this process."""
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and t not in (*_TUNABLES, HUGE_PAGES)]
    return user_setting({**env, "GLIBC_TUNABLES": ":".join(tunables)})


def map_large_blocks_here(env: Mapping[str, str]) -> tuple[bool, str]:
    """Maps blocks of ``MAP_LARGE_THRESHOLD`` and more on their own in this process (``mallopt(M_MMAP_THRESHOLD)``),
    so that a freed tensor leaves the resident set at once; for a strategy whose point is memory (ShardedStrategy).
    Not without glibc, not over a setting the user made (``env``: this process's environment; the launcher's own
    thresholds do not count). Returns (applied, why) for ``explain()`` and the memory plan."""
    if GLIBC is None:
        return False, "not glibc: the C library's own policy, not planned"
    made = _setting_besides_launchers(env)
    if made is not None:
        return False, f"the user's setting ({made}) kept"
    if not _mallopt(_M_MMAP_THRESHOLD, MAP_LARGE_THRESHOLD):
        return False, "mallopt(M_MMAP_THRESHOLD) not found or refused"
    return (
        True,
        f"blocks of {MAP_LARGE_THRESHOLD >> 10} KiB and more mapped alone and unmapped when freed (M_MMAP_THRESHOLD)",
    )


def reuse_freed_blocks_here() -> bool:
    """Undoes ``map_large_blocks_here`` from now on: blocks up to ``MMAP_THRESHOLD`` come from the heap again, and a
    freed one is kept for the next that fits (blocks mapped before stay mapped and are unmapped when freed). For
    ShardedStrategy(host_memory="reuse") once its long-lived state exists. Returns whether glibc took it."""
    return GLIBC is not None and _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def trim_here() -> None:
    """Hands the heap's free pages back to the system (glibc's ``malloc_trim(0)``); nothing elsewhere."""
    if GLIBC is None:
        return
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = (ctypes.c_size_t,)
    trim(0)


def describe(env: Mapping[str, str], *, glibc: tuple[int, int] | None = GLIBC) -> tuple[str, str]:
    """How this process treats freed host memory, as (choice, reason), for ``explain()``; whether its blocks ask
    for huge pages (``HUGE_PAGES`` in its ``GLIBC_TUNABLES``) is said after the reason."""
    choice, why = _describe_release(env, glibc=glibc)
    if glibc is not None and glibc >= _HUGE_PAGES_SINCE and HUGE_PAGES in env.get("GLIBC_TUNABLES", "").split(":"):
        why += f"; blocks of 2 MiB and more and the heap ask for transparent huge pages ({HUGE_PAGES})"
    return choice, why


def _describe_release(env: Mapping[str, str], *, glibc: tuple[int, int] | None) -> tuple[str, str]:
    if glibc is None:
        return "the C library's default", "not glibc, so not tuned"
    if _applied_here:
        return "kept for reuse", "glibc's trim threshold 1 GiB and mmap threshold 32 MiB (set through mallopt)"
    if glibc >= _TUNABLES_SINCE and set(_TUNABLES) <= set(env.get("GLIBC_TUNABLES", "").split(":")):
        return "kept for reuse", f"glibc's trim threshold 1 GiB and mmap threshold 32 MiB ({_OURS})"
    made = user_setting(env, glibc=glibc)
    if made is not None:
        return "as set by the user", made
    if glibc < _TUNABLES_SINCE:
        return "returned to the system", (
            f"glibc {glibc[0]}.{glibc[1]} reads no GLIBC_TUNABLES (2.26 and newer do); "
            "set MALLOC_TRIM_THRESHOLD_=1073741824 MALLOC_MMAP_THRESHOLD_=33554432"
        )
    why = (
        "glibc's default: a CPU training step faults its buffers in again every step; "
        f"`stratagem launch` sets GLIBC_TUNABLES={_OURS} for its tasks (see docs/clusters.md)"
    )
    return "returned to the system", why
