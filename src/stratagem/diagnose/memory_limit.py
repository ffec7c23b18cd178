"""The memory this process may still take before something stops it: a cgroup's limit, an rlimit, a GPU's free memory.

Read before step 1, so that a memory plan over it is refused with a strategy that fits rather than left to the
kernel's OOM killer (docs/sharded.md, "The limit"). `memory_limit` is pure (the texts of the files, the rlimits and
the process's sizes are passed in) and unit-tested; `read_memory_limit` reads them for this process.

    >>> limit = memory_limit(proc_cgroup="4:memory:/job\\n", files={"/sys/fs/cgroup/memory/job/memory.limit_in_bytes":
    ...     "1073741824", "/sys/fs/cgroup/memory/job/memory.usage_in_bytes": "268435456"}.get)
    >>> limit.headroom, limit.source
    (805306368, 'cgroup v1 /job (memory.limit_in_bytes)')
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass

UNLIMITED_V1 = 1 << 62
"""cgroup v1 writes "no limit" as a number near 2**63 (rounded down to a page); anything above this is none."""


@dataclass(frozen=True, kw_only=True)
class MemoryLimit:
    """The tightest memory limit on this process, what already counts against it, and where it was read."""

    limit: int | None
    """Bytes the process (or its cgroup) may hold; None: no limit was found."""
    used: int = 0
    """Bytes that already count against `limit` (the cgroup's usage, the process's address space or data)."""
    source: str = "none found"
    """Where `limit` was read, for errors and `stratagem doctor`."""

    @property
    def headroom(self) -> int | None:
        """Bytes still free under the limit (None: no limit)."""
        return None if self.limit is None else max(self.limit - self.used, 0)

    def to_dict(self) -> dict[str, object]:
        return {"limit": self.limit, "used": self.used, "headroom": self.headroom, "source": self.source}


def _cgroup_limits(proc_cgroup: str, read: Callable[[str], str | None], root: str) -> list[MemoryLimit]:
    found = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2's unified hierarchy
            version, base, limit_file, usage_file = "v2", root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            version, base, limit_file, usage_file = (
                "v1",
                f"{root}/memory",
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        else:
            continue
        path = path.rstrip("/")
        while True:  # the cgroup and its ancestors: a parent's limit binds its children too
            text = read(f"{base}{path}/{limit_file}")
            if text is not None and text.strip() not in ("", "max") and int(text) < UNLIMITED_V1:
                usage = read(f"{base}{path}/{usage_file}")
                where = f"cgroup {version} {path or '/'} ({limit_file})"
                found.append(MemoryLimit(limit=int(text), used=int(usage or 0), source=where))
            if not path:
                break
            path = path.rpartition("/")[0]
    return found


def memory_limit(
    *,
    proc_cgroup: str = "",
    files: Callable[[str], str | None] = lambda path: None,
    rlimit_as: int | None = None,
    rlimit_data: int | None = None,
    virtual_size: int = 0,
    data_size: int = 0,
    gpu_free: tuple[int, int] | None = None,
    cgroup_root: str = "/sys/fs/cgroup",
) -> MemoryLimit:
    """The tightest of the limits given (the least headroom), or `MemoryLimit(limit=None)`.

    `proc_cgroup`: the text of /proc/self/cgroup; `files`: a path's text or None; `rlimit_as`, `rlimit_data`: the
    soft limits (None: unlimited) against `virtual_size` and `data_size` (VmSize, VmData); `gpu_free`: (free, total)
    bytes of this process's GPU."""
    limits = _cgroup_limits(proc_cgroup, files, cgroup_root)
    if rlimit_as is not None:
        limits.append(MemoryLimit(limit=rlimit_as, used=virtual_size, source="RLIMIT_AS (address space, ulimit -v)"))
    if rlimit_data is not None:
        limits.append(MemoryLimit(limit=rlimit_data, used=data_size, source="RLIMIT_DATA (data segment, ulimit -d)"))
    if gpu_free is not None:
        free, total = gpu_free
        limits.append(MemoryLimit(limit=total, used=total - free, source="the GPU's free memory"))
    return min(limits, key=lambda found: found.headroom or 0, default=MemoryLimit(limit=None))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _status_bytes(text: str, field: str) -> int:
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _soft(which: int) -> int | None:
    soft, _ = resource.getrlimit(which)
    return None if soft == resource.RLIM_INFINITY else soft


def read_memory_limit(device: object = None) -> MemoryLimit:
    """This process's tightest memory limit now; on a CUDA `device`, its free memory (device memory, not host)."""
    import torch

    device = torch.device(device) if device is not None else torch.device("cpu")  # type: ignore[call-overload]
    if device.type == "cuda":
        return memory_limit(gpu_free=torch.cuda.mem_get_info(device))
    status = _read("/proc/self/status") or ""
    return memory_limit(
        proc_cgroup=_read("/proc/self/cgroup") or "",
        files=_read,
        rlimit_as=_soft(resource.RLIMIT_AS),
        rlimit_data=_soft(resource.RLIMIT_DATA),
        virtual_size=_status_bytes(status, "VmSize"),
        data_size=_status_bytes(status, "VmData"),
    )
