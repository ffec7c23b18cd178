"""Files in ``/dev/shm`` that processes of one host map to share memory, and how a process tells who is who.

Two users: the sums of co-located multi-worker workers (``shm.sums``) and the pulls and pushes
of a worker and a parameter server on one host (``shm.parameter_server``). Both follow the same
rules, which live here:

- it is readable and writable by its maker's user only (mode 0600, as ``mkstemp`` makes it), under
  a name with a random part, and a process maps only a regular file of its own user;
- the file's space is reserved when it is made (``posix_fallocate``): a tmpfs that runs out would
  otherwise kill the first process to write past its end with SIGBUS;
- it begins with a random ``head`` (a magic and a nonce) that the maker sends to the others over an
  authenticated channel; a process that maps the file checks it, so a namesake in another
  ``/dev/shm`` (another container, another host) is never taken for it;
- it is unlinked as soon as every party has mapped it (by whichever party sees that first), so
  nothing is left behind even if the job is killed afterwards, and nobody can open (or truncate) it;
- its name carries its maker (a tag of this host, the pid and the process's start time), so a file
  left by a maker killed in the short window before every party mapped it is removed by the next
  ``create`` on this host (``remove_stale``) once that process is gone.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import re
import socket
import stat
import tempfile

import numpy
import torch

DIRECTORY = "/dev/shm"
# stratagem-<kind->?<host tag>_<pid>_<start time>_<random>: every file this module makes.
_OWNED = re.compile(r"stratagem-(?:[a-z]+-)?([0-9a-f]{8})_([0-9]+)_([0-9]+)_[a-z0-9_]+\Z")
logger = logging.getLogger(__name__)


def host_identity() -> str:
    """This machine, as processes compare it: the host name and the kernel's boot id (two containers may
    share a name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def process_start(pid: int) -> str | None:
    """When process ``pid`` started (field 22 of /proc/<pid>/stat, clock ticks after boot), or None if it is
    gone or a zombie. With the pid it names one process, even once the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return fields[19].decode()


def _host_tag() -> str:
    return hashlib.sha256(host_identity().encode()).hexdigest()[:8]


def remove_stale(directory: str) -> list[str]:
    """Removes the files of ``directory`` that this module made on this host for a process that is gone
    (its pid no longer runs, or runs another process); returns their names. A file of a live process, of
    another host or container (another host tag), or of another user is left alone."""
    removed: list[str]
    tag, removed = _host_tag(), []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = _OWNED.match(name)
        if match is None or match.group(1) != tag:
            continue
        pid, started = int(match.group(2)), match.group(3)
        if process_start(pid) == started:
            continue
        path = os.path.join(directory, name)
        try:
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                os.unlink(path)
                removed.append(name)
        except OSError:
            continue  # gone already, or not ours to remove
    if removed:
        logger.info(
            "removed %d file(s) left in %s by processes that are gone: %s", len(removed), directory, ", ".join(removed)
        )
    return removed


def unlink(path: str) -> None:
    """Removes the file if it is still there (another party may have removed it first)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def create(directory: str, size: int, head: bytes, prefix: str = "stratagem-") -> tuple[str | None, str | None]:
    """Makes a file of ``size`` bytes (space reserved, readable by this user only) that starts with ``head``;
    returns its path, or None and why not. Files that processes now gone left in ``directory`` are removed
    first (``remove_stale``)."""
    remove_stale(directory)
    pid = os.getpid()
    owner = f"{_host_tag()}_{pid}_{process_start(pid) or 0}_"
    try:
        fd, path = tempfile.mkstemp(prefix=prefix + owner, dir=directory)
    except OSError as exc:
        return None, f"cannot create a file in {directory} ({exc.strerror})"
    try:
        os.posix_fallocate(fd, 0, size)
        os.pwrite(fd, head, 0)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        return None, f"{directory} has no room for {size / 2**20:.1f} MiB ({exc.strerror})"
    os.close(fd)
    return path, None


def open_mapped(path: str, size: int, head: bytes, *, maker: str = "its maker") -> tuple[mmap.mmap | None, str | None]:
    """Maps the file another process made with ``create`` and checks that it is that file (``head``, a
    regular file of this user, ``size`` bytes); returns the mapping, or None and why not."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return None, f"cannot open {path} ({exc.strerror}), so this /dev/shm is not the one of {maker}"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            return None, f"{path} is not a file of this user, so not the one {maker} made"
        if info.st_size != size:
            return None, f"{path} is not the file {maker} made (size {info.st_size}, expected {size})"
        mapping = mmap.mmap(fd, size)
    except OSError as exc:
        # A memory cap (ulimit -v), too many mappings (vm.max_map_count): a reason to fall back, which every
        # party learns through the meeting, rather than an exception that leaves the others waiting.
        amount = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{-(-size // 1024)} KiB"
        return None, f"cannot map {amount} of {path} ({exc.strerror or exc})"
    finally:
        os.close(fd)
    if mapping[: len(head)] != head:
        mapping.close()
        return None, f"{path} is not the file {maker} made (another nonce)"
    return mapping, None


def as_tensor(mapping: mmap.mmap) -> torch.Tensor:
    """The mapping's bytes as a uint8 tensor whose views keep it mapped.

    ``torch.frombuffer`` does not hold the buffer: ``mapping.close()`` would unmap the memory under a
    live tensor (a crash at its next use). Through numpy, every view holds an export of the
    buffer, so ``close()`` raises ``BufferError`` while one lives, and the memory is unmapped when the
    last view is freed.
    """
    return torch.from_numpy(numpy.frombuffer(mapping, dtype=numpy.uint8))
