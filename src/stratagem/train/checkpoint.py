"""Checkpoints written atomically and verified when read, and the random states a run needs to continue exactly.

A checkpoint is written to a temporary file in the same directory, flushed to disk (fsync),
renamed over the old one (``os.replace``, atomic on POSIX) and the directory entry is flushed
too. A process killed at any moment therefore leaves either the previous checkpoint or the
new one, never a torn file. The temporary's name is ``.stratagem-partial.<name>.<16 hex
digits>.tmp``: `remove_stale_temporaries` removes only files of exactly that form, never
another hidden ``.tmp`` file that happens to share the directory.

Checkpoints are read through `stratagem.archive.load_verified`: the CRC32 that torch writes for
every member of the archive is checked first (a byte flipped in a tensor's data is refused,
with the file named), then ``torch.load(weights_only=True)`` reads only tensors and plain
containers, nothing is unpickled that could run code.

Example:
    >>> save_checkpoint("backup/state.pt", {"model": model.state_dict(), "rng": capture_rng_state()})
    >>> state = load_checkpoint("backup/state.pt")
    >>> model.load_state_dict(state["model"]); restore_rng_state(state["rng"])
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from stratagem.archive import load_verified
from stratagem.errors import CheckpointWriteError, InputError

try:
    import resource
except ImportError:  # Windows: no file-size limits to report
    resource = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

FORMAT = "stratagem-checkpoint"
VERSION = 1
_TEMP_PREFIX = ".stratagem-partial."
_TEMP_SUFFIX = ".tmp"
_TEMP_RANDOM = re.compile(r"\.[0-9a-f]{16}" + re.escape(_TEMP_SUFFIX) + r"\Z")


def save_checkpoint(
    path: str | os.PathLike[str], state: dict[str, Any], *, previous: str | os.PathLike[str] | None = None
) -> Path:
    """Writes `state` to `path` atomically (temp file, fsync, rename, fsync of the directory).

    The directory is created if needed. With `previous`, the checkpoint that `path` held is
    kept there once the new one is complete. The order is: write the temporary and fsync it,
    rename `path` to `previous` (replacing the one before), rename the temporary to `path`. A
    crash at any point leaves a whole checkpoint: before the first rename both old ones are
    untouched; between the renames `previous` holds the newest (a reader falls back to it); after,
    both are new. The price is room for three files at once. Returns the path written.

    Raises:
        InputError: `state` is not a dict.
        CheckpointWriteError: the file could not be written (a full disk, a file-size limit, a read-only
            file system...); the message names the path and the cause, and what was on disk before is kept.
    """
    if not isinstance(state, dict):
        raise InputError(f"A checkpoint is a dict of state. Received: {type(state).__name__}.")
    path = Path(path)
    payload = {"format": FORMAT, "version": VERSION, **state}
    keep = Path(previous) if previous is not None else None
    needed = state_bytes(payload)
    temp_name: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _check_room(path, needed)
        fd, temp_name = _create_temporary(path)
        with os.fdopen(fd, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())  # the bytes are on disk before any name points at them
        if keep is not None and path.exists():
            os.replace(path, keep)  # killed right after: `keep` is the newest checkpoint, whole
        os.replace(temp_name, path)
        fsync_directory(path.parent)  # the renames themselves survive a power cut
    except BaseException as error:
        if temp_name is not None:
            Path(temp_name).unlink(missing_ok=True)
        if isinstance(error, Exception) and not isinstance(error, CheckpointWriteError):
            raise write_error(path, error, needed) from error
        raise
    return path


def state_bytes(state: Any) -> int:
    """The bytes of the tensors in a nest of dicts, lists and tuples: roughly the size ``torch.save`` writes."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    return 0


def _check_room(path: Path, needed: int) -> None:
    free = shutil.disk_usage(path.parent).free
    if free < needed:
        raise CheckpointWriteError(
            f"Cannot write the checkpoint {str(path)!r}: the file system is full. It needs about {_size(needed)} and "
            f"{_size(free)} is free in {str(path.parent)!r}. Received: path={str(path)!r}. Free some space there or "
            "point the checkpoint at a larger file system; the checkpoints already there are kept."
        )


def write_error(path: Path, error: BaseException, needed: int) -> CheckpointWriteError:
    """A `CheckpointWriteError` naming `path` and the likely cause of `error` (torch's writer hides the OSError)."""
    cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
    number = getattr(error, "errno", None)
    try:
        free: int | None = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    limit = _file_size_limit()
    if number == errno.EFBIG or (limit is not None and limit < needed):
        why = f"the file-size limit of this process (ulimit -f) is {_size(limit or 0)}, and it needs about {_size(needed)}"
        fix = "Raise the limit (ulimit -f unlimited) or make the checkpoint smaller"
    elif number in (errno.ENOSPC, errno.EDQUOT) or (free is not None and free < needed):
        why = f"the file system is full: it needs about {_size(needed)} and {_size(free or 0)} is free"
        fix = "Free some space there or point the checkpoint at a larger file system"
    elif number == errno.EROFS or number == errno.EACCES or number == errno.EPERM:
        why = f"the directory cannot be written ({os.strerror(number)})"
        fix = "Choose a directory this process can write to"
    else:
        why = f"writing it failed ({_size(free)} free there)" if free is not None else "writing it failed"
        fix = "Check the disk and the file system that holds it"
    return CheckpointWriteError(
        f"Cannot write the checkpoint {str(path)!r}: {why} ({cause}). Received: path={str(path)!r}. {fix}; the "
        "checkpoints already there are kept as they were."
    )


def _file_size_limit() -> int | None:
    """This process's limit on the size of a file it writes (RLIMIT_FSIZE), or None when there is none."""
    if resource is None:
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _size(num_bytes: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} bytes"


def _create_temporary(path: Path) -> tuple[int, str]:
    """A new file beside `path`, readable by its owner only, with a name `remove_stale_temporaries` recognises."""
    for _ in range(16):  # 64 random bits: a clash is all but impossible, and O_EXCL never reuses a name
        name = path.parent / f"{_TEMP_PREFIX}{path.name}.{secrets.token_hex(8)}{_TEMP_SUFFIX}"
        try:
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o600), str(name)
        except FileExistsError:
            continue
    raise FileExistsError(f"Could not create a temporary file beside {str(path)!r}: every name tried exists.")


def load_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any]:
    """Reads a checkpoint written by `save_checkpoint`, after checking the checksums of its archive.

    Raises:
        InputError: no file at `path`, or the file is not a stratagem checkpoint.
        CorruptCheckpointError: the file is damaged (a checksum differs, it is truncated) or
            torch cannot read it; the message names the file.
    """
    path = Path(path)
    state = load_verified(path, map_location=map_location)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        received = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise InputError(
            f"The file {str(path)!r} is not a stratagem checkpoint. Received: format={received!r:.100}. "
            "Load it with torch.load, or point at a file written by save_checkpoint."
        )
    return state


def is_temporary_of(name: str, checkpoint_name: str | None = None) -> bool:
    """Whether `name` is a temporary that `save_checkpoint` made (for `checkpoint_name`, when given)."""
    random_part = _TEMP_RANDOM.search(name)
    if not name.startswith(_TEMP_PREFIX) or random_part is None:
        return False
    target = name[len(_TEMP_PREFIX) : random_part.start()]
    return bool(target) and (checkpoint_name is None or target == checkpoint_name)


def remove_stale_temporaries(directory: str | os.PathLike[str], checkpoint_name: str | None = None) -> list[Path]:
    """Deletes the temporary files that a process killed while saving left in `directory`.

    Only regular files named as `save_checkpoint` names its temporaries
    (``.stratagem-partial.<checkpoint_name>.<16 hex digits>.tmp``) are removed; with
    `checkpoint_name`, only those of that checkpoint. Returns the paths removed.
    """
    directory = Path(directory)
    removed = []
    if directory.is_dir():
        with os.scandir(directory) as entries:
            for entry in entries:
                if is_temporary_of(entry.name, checkpoint_name) and entry.is_file(follow_symlinks=False):
                    Path(entry.path).unlink(missing_ok=True)
                    removed.append(Path(entry.path))
    return sorted(removed)


def fsync_directory(directory: Path) -> None:
    """Flushes `directory`'s entries (renames, new files) to disk."""
    if sys.platform == "win32":  # directories cannot be opened for fsync there; the rename is durable enough
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def capture_rng_state() -> dict[str, Any]:
    """The states of torch's CPU and CUDA generators, Python's `random` and NumPy's global generator.

    NumPy is captured only when it is already imported (a run that never imported it never used it).
    """
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": _python_state_to_plain(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Puts back the generator states that `capture_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(_python_state_from_plain(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        _restore_cuda_rng(list(state["cuda"]), torch.cuda.device_count())
    if "numpy" in state:
        import numpy

        saved = state["numpy"]
        numpy.random.set_state(
            (
                saved["name"],
                saved["keys"].numpy().astype("uint32"),
                saved["pos"],
                saved["has_gauss"],
                saved["cached_gaussian"],
            )
        )


def _restore_cuda_rng(saved: list[torch.Tensor], count: int) -> None:
    """Each GPU this process sees gets its saved state, as far as the checkpoint has one; the run may resume
    on fewer or more GPUs than it saved on (set_rng_state_all would fail on a GPU that does not exist)."""
    for index, gpu_state in enumerate(saved[:count]):
        torch.cuda.set_rng_state(gpu_state, index)
    if len(saved) != count:
        logger.warning(
            "The checkpoint holds random states for %d GPU(s) and this process sees %d: %s.",
            len(saved),
            count,
            f"the states of GPUs {count}..{len(saved) - 1} are not restored"
            if len(saved) > count
            else f"GPUs {len(saved)}..{count - 1} keep their current streams",
        )


def _python_state_to_plain(state: tuple) -> list[Any]:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _python_state_from_plain(state: list[Any]) -> tuple:
    version, internal, gauss = state
    return version, tuple(internal), gauss
