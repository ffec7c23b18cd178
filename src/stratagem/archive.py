"""Reading a file written by ``torch.save`` safely: its checksums verified, nothing unpickled but tensors.

``torch.save`` writes a zip archive that holds a CRC32 for each member (the pickled structure,
and the bytes of each tensor), but ``torch.load`` never compares them: a byte flipped in a
tensor's data loads without a word. `load_verified` first reads every member once and compares
its CRC32 (`verify_archive`), then reads the file with ``torch.load(weights_only=True)``, so a
damaged file is refused with its name and the member that failed, and nothing but tensors and
plain containers is ever unpickled.

The archive's own checksums rather than a digest of our own, because they are already in every
file torch writes (files written before this check included), they cover each member, so the
error says which part is damaged, and nothing else has to be written and kept in step with the
file (a digest in a second file would need an atomic update of its own). CRC32 catches
accidental damage (a flipped bit, a burst of up to 32 bits, a truncated or overwritten block);
it does not stop someone who can write the file, who can recompute it. ``weights_only=True`` is
what keeps such a file from running code.

Example:
    >>> state = load_verified("backup/backup.pt")   # CorruptCheckpointError if a checksum differs
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from stratagem.errors import CorruptCheckpointError, InputError

_CHUNK = 1 << 20  # members are read in pieces: memory stays flat whatever the size of a tensor
_SHOWN = 300  # characters of a foreign error message quoted in ours


def verify_archive(path: str | os.PathLike[str]) -> int:
    """Reads every member of the zip archive at `path` and checks its CRC32; returns the bytes checked.

    Raises:
        CorruptCheckpointError: the file is not a zip archive, is truncated, or a member's
            checksum differs from the one written with it (the message names the member).
    """
    path = Path(path)
    checked = 0
    try:
        archive = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise
    except Exception as error:  # noqa: BLE001 - BadZipFile, OSError, EOFError... for a file that is no archive
        raise _damaged(
            path,
            f"it is not a zip archive as torch.save writes ({_cut(str(error))})",
            "a file torch.save did not write, or one whose end (the archive's directory) is damaged or cut off",
        ) from None
    try:
        with archive:
            members = archive.infolist()
            if not members:
                raise _damaged(path, "it is an empty zip archive", "an archive with no members")
            for member in members:
                # Reading a member to its end is what makes zipfile compare the CRC32.
                with archive.open(member) as stream:
                    while chunk := stream.read(_CHUNK):
                        checked += len(chunk)
    except CorruptCheckpointError:
        raise
    except FileNotFoundError:
        raise
    except Exception as error:  # noqa: BLE001 - zipfile raises many types (BadZipFile, EOFError, OSError...)
        raise _damaged(
            path,
            f"it is damaged ({_cut(str(error)) or type(error).__name__})",
            "a member whose bytes differ from those written (its CRC32 or its header does not match)",
        ) from None
    return checked


def load_verified(path: str | os.PathLike[str], map_location: Any = "cpu") -> Any:
    """`verify_archive`, then ``torch.load(path, weights_only=True)``; every failure names the file.

    Raises:
        InputError: no file at `path`, or it holds objects other than tensors and plain
            containers (which would need unpickling code).
        CorruptCheckpointError: the file is damaged (see `verify_archive`) or torch cannot read it.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(
            f"No checkpoint at {str(path)!r}. Received: path={str(path)!r}. Check the path, or start without restoring."
        )
    try:
        verify_archive(path)
    except FileNotFoundError:
        raise InputError(
            f"The checkpoint {str(path)!r} went away while it was read. Received: path={str(path)!r}. "
            "Check that no other job writes or deletes this directory."
        ) from None
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # torch raises several types for a file it cannot read
        if isinstance(error, pickle.UnpicklingError) and "Weights only load failed" in str(error):
            raise InputError(
                f"The file {str(path)!r} holds objects other than tensors and plain containers "
                f"({_weights_only_reason(error)}). Received: a file that torch.load(weights_only=True) refuses. "
                "stratagem never unpickles such objects, as they can run code: write the file with "
                "stratagem.train.save_checkpoint (tensors, numbers, strings, lists, dicts), or point at another file."
            ) from None
        first_line = str(error).splitlines()[0] if str(error) else ""
        if not _written_by_torch(path):
            raise _damaged(
                path,
                f"it is a zip archive, but not one torch.save wrote (no data.pkl member; {type(error).__name__}: "
                f"{_cut(first_line)})",
                "a zip archive of other files",
            ) from None
        # Every member's bytes match their CRC32, so the damage is where no checksum reaches: the zip's directory
        # or a member's header (names, sizes, offsets), which torch's reader follows and Python's tolerates.
        raise _damaged(
            path,
            "its zip directory or a member's header is damaged (the parts of the archive no checksum covers: names, "
            f"sizes, offsets), so torch cannot read it ({type(error).__name__}: {_cut(first_line)})",
            "an archive whose members' bytes match their CRC32 but whose directory or headers are damaged",
        ) from None


def _written_by_torch(path: Path) -> bool:
    """Whether the archive's directory lists the member every torch.save archive has (``<name>/data.pkl``)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") for name in archive.namelist())
    except Exception:  # noqa: BLE001 - read once already; whatever fails now, the directory is not torch's
        return False


def _damaged(path: Path, reason: str, received: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"The file {str(path)!r} is not a readable checkpoint: {reason}. Received: {received}. Restore it from a "
        "copy, point at another checkpoint, or remove it to start afresh; if it was written whole, check the disk "
        "or file system that holds it."
    )


def _weights_only_reason(error: Exception) -> str:
    """torch's one line that says what was refused, without its advice to turn the check off."""
    for line in str(error).splitlines():
        line = line.strip()
        if line.startswith("WeightsUnpickler error:"):
            reason = line.removeprefix("WeightsUnpickler error:").strip()
            return _cut(reason.split(" was not an allowed global")[0])  # the rest is how to allow it
    return "an object weights_only=True does not allow"


def _cut(text: str) -> str:
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."
