"""Checkpoints written atomically, and the random states a run needs to continue exactly.

A checkpoint is written to a temporary file in the same directory, flushed to disk (fsync),
renamed over the old one (``os.replace``, atomic on POSIX) and the directory entry is flushed
too. A process killed at any moment therefore leaves either the previous checkpoint or the
new one, never a torn file. Checkpoints are read with ``torch.load(weights_only=True)``: only
tensors and plain containers, nothing is unpickled that could run code.

Example:
    >>> save_checkpoint("backup/state.pt", {"model": model.state_dict(), "rng": capture_rng_state()})
    >>> state = load_checkpoint("backup/state.pt")
    >>> model.load_state_dict(state["model"]); restore_rng_state(state["rng"])
"""

from __future__ import annotations

import logging
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from stratagem.errors import InputError

logger = logging.getLogger(__name__)

FORMAT = "stratagem-checkpoint"
VERSION = 1
_TEMP_SUFFIX = ".tmp"


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Writes `state` to `path` atomically (temp file, fsync, rename, fsync of the directory).

    The directory is created if needed. Returns the path written.

    Raises:
        InputError: `state` is not a dict.
    """
    if not isinstance(state, dict):
        raise InputError(f"A checkpoint is a dict of state. Received: {type(state).__name__}.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "version": VERSION, **state}
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())  # the bytes are on disk before the name points at them
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)  # the rename itself survives a power cut
    return path


def load_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any]:
    """Reads a checkpoint written by `save_checkpoint`.

    Raises:
        InputError: no file at `path`, or the file is not a stratagem checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"No checkpoint at {str(path)!r}. Received: path={str(path)!r}. "
                         "Check the path, or start without restoring.")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # torch raises several types for a file it cannot read
        raise InputError(f"The file {str(path)!r} is not a readable checkpoint ({type(error).__name__}: {error}). "
                         "Received: a file that torch.load(weights_only=True) rejects. Remove it or point at another "
                         "checkpoint.") from error
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        received = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise InputError(f"The file {str(path)!r} is not a stratagem checkpoint. Received: format={received!r}. "
                         "Load it with torch.load, or point at a file written by save_checkpoint.")
    return state


def remove_stale_temporaries(directory: str | os.PathLike[str]) -> list[Path]:
    """Deletes temporary files that a process killed while saving left in `directory`."""
    directory = Path(directory)
    removed = []
    if directory.is_dir():
        for leftover in directory.glob(f".*{_TEMP_SUFFIX}"):
            leftover.unlink(missing_ok=True)
            removed.append(leftover)
    return removed


def _fsync_directory(directory: Path) -> None:
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
        state["numpy"] = {"name": str(name), "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
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
        numpy.random.set_state((saved["name"], saved["keys"].numpy().astype("uint32"), saved["pos"],
                                saved["has_gauss"], saved["cached_gaussian"]))


def _restore_cuda_rng(saved: list[torch.Tensor], count: int) -> None:
    """Each GPU this process sees gets its saved state, as far as the checkpoint has one; the run may resume
    on fewer or more GPUs than it saved on (set_rng_state_all would fail on a GPU that does not exist)."""
    for index, gpu_state in enumerate(saved[:count]):
        torch.cuda.set_rng_state(gpu_state, index)
    if len(saved) != count:
        logger.warning(
            "The checkpoint holds random states for %d GPU(s) and this process sees %d: %s.", len(saved), count,
            f"the states of GPUs {count}..{len(saved) - 1} are not restored" if len(saved) > count
            else f"GPUs {len(saved)}..{count - 1} keep their current streams")


def _python_state_to_plain(state: tuple) -> list[Any]:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _python_state_from_plain(state: list[Any]) -> tuple:
    version, internal, gauss = state
    return version, tuple(internal), gauss
