"""A backup directory checked before the first step: it can be made, written, and has room for the backups.

`fit` calls `check_backup_directory` for every `BackupAndRestore` before it distributes the model,
so a missing-and-uncreatable, read-only or wrong-type directory is refused before any work,
whichever entry point started the run (the API, ``stratagem train``, a script under ``stratagem
launch``). The chief calls `check_room_for_backups` once it knows the size of the state: a backup
keeps up to three files at once (the newest, the previous, and the one being written), so a disk
that cannot hold them is refused at the start, not an epoch in.

Example:
    >>> check_backup_directory("/shared/run1/backup")   # InputError if it cannot hold files
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from stratagem.errors import InputError
from stratagem.train.checkpoint import state_bytes

CLUSTER_TOKEN = "STRATAGEM_CLUSTER_TOKEN"
"""The job's token that ``stratagem launch`` gives every task; a claim records a digest of it, never the secret."""


def job_id(token: str | None) -> str | None:
    """A digest of the job's token that can be written where others read it (the token is a shared secret)."""
    return None if not token else hashlib.sha256(token.encode()).hexdigest()[:16]


def check_backup_directory(path: str | os.PathLike[str]) -> Path:
    """Proves `path` is (or can be made) a directory this process can write files into.

    Directories created for the check are removed again; the run creates them when it starts.

    Raises:
        InputError: `path` is a file, an ancestor is a file, it cannot be created, or a file cannot be
            written in it (read-only file system, no permission); the message names the cause.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(
            f"backup_dir must be a directory. Received: backup_dir={str(path)!r}, which is a file. Choose a "
            "directory path (it is created if missing)."
        )
    blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise InputError(
            f"backup_dir cannot be created: {str(blocking)!r} on its path is a file. Received: "
            f"backup_dir={str(path)!r}. Choose a directory path whose parents are directories."
        )
    created = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".stratagem-write-check-") as probe:
            probe.write(b"x")
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as error:
        raise InputError(
            f"backup_dir cannot hold backups: {'creating' if created else 'writing into'} {str(path)!r} failed "
            f"({error.strerror or error}). Received: backup_dir={str(path)!r}. Choose a directory this process can "
            "write to."
        ) from None
    finally:
        for directory in created:  # deepest first
            try:
                directory.rmdir()
            except OSError:
                pass
    return path


def check_room_for_backups(directory: Path, state: dict[str, Any], existing: list[Path], *, files: int = 3) -> int:
    """Refuses a `directory` whose file system cannot hold `files` backups of `state` (counting those there).

    The size is that of the tensors now; an optimizer whose state is still empty (Adam's moments appear at
    the first step) is counted as holding two tensors per parameter. Returns the bytes one backup needs.

    Raises:
        InputError: the free space is less than what the backups still need.
    """
    one = state_bytes(state)
    optimizer = state.get("optimizer") if isinstance(state, dict) else None
    if isinstance(optimizer, dict) and not optimizer.get("state"):
        one += 2 * state_bytes(state.get("model"))
    already = sum(p.stat().st_size for p in existing if p.exists())
    needed = max(0, files * one - already)
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise InputError(
            f"backup_dir has too little free space: its backups need about {_megabytes(needed)} more "
            f"({files} files of about {_megabytes(one)}: the newest, the previous and the one being written) and "
            f"{_megabytes(free)} is free. Received: backup_dir={str(directory)!r}. Free some space there, choose a "
            "larger file system, or pass keep_previous=False (two files instead of three)."
        )
    return one


def _megabytes(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MB"
