"""One job per backup directory: the chief's claim on it, locked for the job's life.

The claim is the file ``.stratagem-claim`` in the backup directory. It names its owner (host, pid,
the process's start time, the job's token, when it was claimed) and the owner holds an exclusive
``fcntl.flock`` on it from before the first step until training ends.

The lock, not the file's existence, says whether the owner lives. An exclusive create
(``O_CREAT|O_EXCL``) says who came first, but a process killed by SIGKILL (a preemption's last word)
leaves its file behind, and only a pid check could tell that it is dead, on its own host only. The
kernel drops a flock when its holder dies, however it dies, so a lock this process can take proves
the previous owner is gone; Linux also carries flock over NFS as a byte-range lock. The file's
contents only name the owner, for the error a second job gets and for the takeover's record. On a
file system without locks (flock fails with ENOLCK or EOPNOTSUPP) the contents decide alone: an
owner on this host whose pid still runs with the same start time keeps the claim; an owner on
another host cannot be checked and keeps it too, until someone removes the file.

Example:
    >>> claim = DirectoryClaim.acquire("/shared/run1/backup", token="job-42")
    >>> claim.took_over_from   # the dead owner it replaced, or None
    >>> claim.release()
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stratagem.errors import BackupDirectoryInUseError, InputError

logger = logging.getLogger(__name__)

CLAIM_NAME = ".stratagem-claim"
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


@dataclass(frozen=True)
class ClaimOwner:
    """Who holds a backup directory."""

    host: str
    pid: int
    start_ticks: int | None
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat``): a reused pid has another."""
    token: str
    """The job's token (``STRATAGEM_CLUSTER_TOKEN`` under ``stratagem launch``, else one per process)."""
    claimed_at: float
    """Seconds since the epoch."""

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.claimed_at))
        return f"pid {self.pid} on host {self.host!r} (job token {self.token[:12]}, claimed {when})"

    def is_alive_here(self) -> bool:
        """Whether this owner is a process of this host that still runs (same pid, same start time)."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # it exists, under another user
        return self.start_ticks is None or _start_ticks(self.pid) in (None, self.start_ticks)


class DirectoryClaim:
    """This process's claim on a backup directory; `acquire` makes one, `release` gives it up."""

    def __init__(self, directory: Path, fd: int, owner: ClaimOwner, took_over_from: ClaimOwner | None) -> None:
        self.directory = directory
        self.owner = owner
        self.took_over_from = took_over_from
        """The owner whose claim was taken over because it no longer runs, or None."""
        self._fd: int | None = fd

    @property
    def path(self) -> Path:
        return self.directory / CLAIM_NAME

    @classmethod
    def acquire(cls, directory: str | os.PathLike[str], token: str | None = None) -> DirectoryClaim:
        """Claims `directory` (which must exist) for this process.

        Raises:
            BackupDirectoryInUseError: another job that still runs holds it.
            InputError: the claim file cannot be written (a read-only directory, for one).
        """
        directory = Path(directory)
        path = directory / CLAIM_NAME
        me = ClaimOwner(
            host=socket.gethostname(),
            pid=os.getpid(),
            start_ticks=_start_ticks(os.getpid()),
            token=token or secrets.token_hex(16),
            claimed_at=time.time(),
        )
        earlier = _HELD.pop(_key(directory), None)
        if earlier is not None and earlier._fd is not None:
            # This process claimed it in a fit that never released it (a callback skipped the clean-up): a lock
            # taken through a second descriptor would conflict with our own, so the claim passes on.
            fd, earlier._fd = earlier._fd, None
            _write_owner(fd, me)
            return cls._held(directory, fd, me, None)
        for _ in range(16):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as error:
                raise InputError(
                    f"Cannot claim the backup directory {str(directory)!r}: creating {str(path)!r} failed "
                    f"({error.strerror or error}). Received: backup_dir={str(directory)!r}. Choose a directory this "
                    "process can write to."
                ) from None
            try:
                claim = cls._claim_open_file(directory, path, fd, me)
            except BaseException:
                os.close(fd)
                raise
            if claim is not None:
                return claim
            os.close(fd)  # the file was replaced while we locked it: lock the new one
        raise BackupDirectoryInUseError(
            f"Cannot claim the backup directory {str(directory)!r}: its claim file kept being replaced. Received: "
            f"backup_dir={str(directory)!r}. Check that no other job is starting on this directory, then retry."
        )

    @classmethod
    def _claim_open_file(cls, directory: Path, path: Path, fd: int, me: ClaimOwner) -> DirectoryClaim | None:
        locked = _try_lock(fd)
        previous = _read_owner(fd)
        if locked is False:
            raise _in_use(directory, previous, "holds the lock on its claim file")
        try:
            same_file = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same_file = False
        if not same_file:  # the owner released (unlinked) it between our open and our lock
            return None
        if locked is None and previous is not None and previous.token != me.token and previous.is_alive_here():
            raise _in_use(directory, previous, "still runs")
        if locked is None and previous is not None and previous.host != me.host:
            raise _in_use(directory, previous, "runs on another host, and this file system has no locks to tell")
        _write_owner(fd, me)
        took_over = previous if previous is not None and previous.pid != me.pid else None
        if took_over is not None:
            logger.warning(
                "Took over the backup directory %s from %s, which no longer runs%s.",
                directory,
                took_over.describe(),
                " (an earlier attempt of this job)" if took_over.token == me.token else "",
            )
        return cls._held(directory, fd, me, took_over)

    @classmethod
    def _held(cls, directory: Path, fd: int, me: ClaimOwner, took_over: ClaimOwner | None) -> DirectoryClaim:
        claim = cls(directory, fd, me, took_over)
        _HELD[_key(directory)] = claim
        return claim

    def release(self) -> None:
        """Removes the claim file (while still locked, so no one claims a file about to vanish) and unlocks."""
        if self._fd is None:
            return
        try:
            if _read_owner(self._fd) == self.owner:
                self.path.unlink(missing_ok=True)
        except OSError:
            pass  # the file system went read-only or away: the lock goes with the descriptor anyway
        finally:
            os.close(self._fd)
            self._fd = None
            if _HELD.get(_key(self.directory)) is self:
                del _HELD[_key(self.directory)]

    @property
    def held(self) -> bool:
        return self._fd is not None


_HELD: dict[str, DirectoryClaim] = {}
"""The claims this process holds, by directory: the kernel's flock is per open file, not per process."""


def _key(directory: Path) -> str:
    return str(directory.resolve())


def read_claim(directory: str | os.PathLike[str]) -> ClaimOwner | None:
    """The owner named in `directory`'s claim file, or None when there is none (or it is unreadable)."""
    try:
        fd = os.open(Path(directory) / CLAIM_NAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        return _read_owner(fd)
    finally:
        os.close(fd)


def _in_use(directory: Path, owner: ClaimOwner | None, how: str) -> BackupDirectoryInUseError:
    who = owner.describe() if owner is not None else "a job whose claim file is not written yet"
    return BackupDirectoryInUseError(
        f"The backup directory {str(directory)!r} belongs to another job: {who}, which {how}. Received: "
        f"backup_dir={str(directory)!r}. Wait for that job to end or stop it, or give this job another backup_dir; "
        f"if that job is surely gone, remove {str(directory / CLAIM_NAME)!r}."
    )


def _try_lock(fd: int) -> bool | None:
    """True: locked; False: another process holds the lock; None: this file system has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno in _NO_LOCKS:
            return None
        raise
    return True


def _write_owner(fd: int, owner: ClaimOwner) -> None:
    data = json.dumps(asdict(owner)).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _read_owner(fd: int) -> ClaimOwner | None:
    try:
        raw = os.pread(fd, 4096, 0)
        fields: Any = json.loads(raw.decode()) if raw else None
        return ClaimOwner(**fields) if isinstance(fields, dict) else None
    except (OSError, ValueError, TypeError):
        return None  # empty (being written) or not ours


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None
