"""What a backup directory (or one checkpoint file) holds, and whether every checksum in it holds.

`inspect_backups` reads each backup file `BackupAndRestore` writes (and any other checkpoint file
named), verifies the CRC32 of every member of its archive (`stratagem.archive.verify_archive`), and
reports its step, epoch, the strategy and world size that wrote it and the sizes of its parts; it
also names the job that holds the directory's claim. ``stratagem checkpoint inspect`` and
``verify`` print it; `export_model` (``stratagem checkpoint export``) writes a backup's plain model
to one torch or safetensors file.

Example:
    >>> report = inspect_backups("/shared/run1/backup")
    >>> report.ok, [f.name for f in report.files]
    (True, ['backup.pt', 'backup.previous.pt'])
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from stratagem.archive import load_verified
from stratagem.errors import CorruptCheckpointError, InputError
from stratagem.strategies.state_shards import hash_file
from stratagem.train.backup.claim import ClaimOwner, read_claim
from stratagem.train.backup.sharded import (
    FORMAT,
    MANIFEST,
    STATE,
    VERSION,
    files_by_rank,
    partial_directory,
    read_whole,
    verify_sharded,
    write_manifest,
)
from stratagem.train.checkpoint import is_temporary_of, load_checkpoint, state_bytes
from stratagem.train.model_checkpoint import write_atomically

BACKUP_FILES = ("backup.pt", "backup.previous.pt", "backup.corrupt.pt")
"""The files `BackupAndRestore` writes, newest first (the last: a damaged backup moved aside)."""
SHARDED_BACKUPS = ("backup.dcp", "backup.previous.dcp", "backup.corrupt.dcp")
"""The directories it writes under a sharded strategy (`stratagem.train.backup.sharded`), in the same order."""
MOVED_ASIDE = ("backup.corrupt.pt", "backup.corrupt.dcp")


@dataclass
class CheckpointFile:
    """One checkpoint file: its size, whether its checksums hold, and what it holds."""

    name: str
    path: str
    bytes: int
    ok: bool
    error: str | None = None
    """Why it cannot be used (a checksum that differs, a file that is no checkpoint), or None."""
    step: int | None = None
    epoch: int | None = None
    """The epoch the run resumes in, counted from 1 (as the progress bar, ``Resumed from ...: epoch N`` and the text
    of ``stratagem checkpoint inspect`` count it); the backup itself stores it from 0."""
    step_in_epoch: int | None = None
    strategy: str | None = None
    num_replicas_in_sync: int | None = None
    num_processes: int | None = None
    parts: dict[str, int] = field(default_factory=dict)
    """Bytes of the tensors of each top-level part (model, optimizer, ...); of a sharded backup, of each rank's files."""
    shards: list[dict[str, Any]] = field(default_factory=list)
    """A sharded backup's files as its manifest lists them: ``name``, ``rank`` (that wrote it), ``num_bytes``."""


@dataclass
class BackupReport:
    """Every checkpoint file of a directory, and who holds the directory."""

    path: str
    files: list[CheckpointFile]
    temporaries: list[str]
    """Temporaries of saves in progress, or of a job that died while saving."""
    owner: dict[str, Any] | None
    """The claim's owner (host, pid, ...), or None when no job holds the directory."""

    @property
    def ok(self) -> bool:
        """Whether there is at least one file and every file's checksums hold."""
        return bool(self.files) and all(f.ok for f in self.files if f.name not in MOVED_ASIDE)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def inspect_backups(path: str | os.PathLike[str]) -> BackupReport:
    """Reads and verifies the backups of the directory `path`, or the one checkpoint file `path`.

    Raises:
        InputError: nothing at `path`, or a directory without any backup file.
    """
    path = Path(path)
    if path.is_file():
        return BackupReport(str(path), [_inspect_file(path)], [], None)
    if path.is_dir() and ((path / MANIFEST).exists() or path.name in SHARDED_BACKUPS):
        return BackupReport(str(path), [_inspect_sharded(path)], [], None)
    if not path.is_dir():
        raise InputError(
            f"No backup directory or checkpoint file at {str(path)!r}. Received: path={str(path)!r}. Give the "
            "backup_dir of BackupAndRestore, or a checkpoint file."
        )
    files = [_inspect_file(path / name) for name in BACKUP_FILES if (path / name).is_file()]
    files += [_inspect_sharded(path / name) for name in SHARDED_BACKUPS if (path / name).is_dir()]
    temporaries = sorted(entry.name for entry in path.iterdir() if is_temporary_of(entry.name))
    if not files and not temporaries:
        raise InputError(
            f"The directory {str(path)!r} holds no backup (none of {', '.join(BACKUP_FILES + SHARDED_BACKUPS)}). "
            "Received: "
            f"path={str(path)!r}. Give the backup_dir of BackupAndRestore while a run is under way or was stopped."
        )
    owner: ClaimOwner | None = read_claim(path)
    return BackupReport(str(path), files, temporaries, asdict(owner) if owner is not None else None)


def _inspect_file(path: Path) -> CheckpointFile:
    size = path.stat().st_size
    try:
        state = load_checkpoint(path)
    except (CorruptCheckpointError, InputError) as error:
        return CheckpointFile(name=path.name, path=str(path), bytes=size, ok=False, error=str(error))
    return CheckpointFile(
        name=path.name,
        path=str(path),
        bytes=size,
        ok=True,
        step=_int(state.get("step")),
        epoch=_counted_from_one(state.get("epoch")),
        step_in_epoch=_int(state.get("step_in_epoch")),
        strategy=state.get("strategy") if isinstance(state.get("strategy"), str) else None,
        num_replicas_in_sync=_int(state.get("num_replicas_in_sync")),
        num_processes=_int(state.get("num_processes")),
        parts={key: state_bytes(value) for key, value in state.items() if state_bytes(value)},
    )


def _inspect_sharded(path: Path) -> CheckpointFile:
    """A sharded backup directory: every file's digest checked, its files by the rank that wrote them."""
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    try:
        manifest = verify_sharded(path)
        listed = {entry["name"] for entry in manifest["files"]}
        state = load_checkpoint(path / STATE) if STATE in listed else {}  # no state: a model `export_sharded` wrote
    except (CorruptCheckpointError, InputError) as error:
        return CheckpointFile(name=path.name, path=str(path), bytes=size, ok=False, error=str(error))
    shards = [{k: entry[k] for k in ("name", "rank", "num_bytes")} for entry in manifest["files"]]
    return CheckpointFile(
        name=path.name,
        path=str(path),
        bytes=size,
        ok=True,
        step=_int(manifest.get("step")),
        epoch=_counted_from_one(manifest.get("epoch")),
        step_in_epoch=_int(manifest.get("step_in_epoch")),
        strategy=manifest.get("strategy") if isinstance(manifest.get("strategy"), str) else None,
        num_replicas_in_sync=_int(state.get("num_replicas_in_sync")),
        num_processes=_int(manifest.get("world_size")),
        parts={f"rank {rank}": sum(f["num_bytes"] for f in files) for rank, files in files_by_rank(manifest).items()},
        shards=shards,
    )


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _counted_from_one(epoch: Any) -> int | None:
    """A backup's 0-based epoch as people count it."""
    value = _int(epoch)
    return None if value is None else value + 1


def newest_whole_backup(path: str | os.PathLike[str]) -> CheckpointFile | None:
    """The whole backup of the latest step in the directory (or the file) `path`, as a resumed run would choose it;
    None when there is none (no directory, no backup, or only damaged ones)."""
    try:
        report = inspect_backups(path)
    except InputError:
        return None
    return _newest(report)


def _newest(report: BackupReport) -> CheckpointFile | None:
    usable = [f for f in report.files if f.ok and f.name not in MOVED_ASIDE]
    return max(usable, key=lambda f: -1 if f.step is None else f.step) if usable else None  # the first of a tie


@dataclass
class Export:
    """What `export_model` wrote: the backup it read, and the damaged ones it passed over."""

    used: CheckpointFile
    skipped: list[CheckpointFile] = field(default_factory=list)
    """Backups that could not be read (their ``error`` says why); when one is newer than ``used``, the export is of
    an older step than the newest backup written."""


SAFETENSORS_EXTRA = "pip install 'stratagem[train]' (or pip install safetensors)"
"""How to get the safetensors package, which `export_model` needs for a ``.safetensors`` target."""


def check_safetensors() -> None:
    """Refuses, before any work, an export to safetensors when the package is not installed."""
    if importlib.util.find_spec("safetensors") is None:
        raise InputError(
            "Writing a .safetensors file needs the safetensors package, which is not installed. Received: an output "
            f"name ending in .safetensors. Install it with {SAFETENSORS_EXTRA}, or name the output model.pt."
        )


def export_model(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> Export:
    """Writes the plain model of a backup (the newest whole one of a directory, or the file `source`) to `target`:
    a ``torch.save`` state_dict, or safetensors when `target` ends in ``.safetensors``. Returns the backup used and
    the damaged ones passed over (say so: an export of ``backup.previous.pt`` is of an older step).

    The keys are those of the model the user built (no replica or wrapper prefix):
    ``model.load_state_dict(torch.load(target))`` or ``safetensors.torch.load_file(target)`` loads it.

    Raises:
        InputError: no whole backup at `source`; `target` is an existing directory; safetensors is not installed.
    """
    target = Path(target)
    if target.suffix == ".dcp":
        return Export(export_sharded(Path(source), target))
    if target.suffix == ".safetensors":
        check_safetensors()
    report = inspect_backups(source)
    newest = _newest(report)
    if newest is None:
        raise InputError(
            f"No whole backup to export in {str(source)!r}. Received: "
            f"{[(f.name, f.error) for f in report.files] or 'no backup files'}. Run `stratagem checkpoint verify` "
            "for the details, or point at another backup."
        )
    if target.is_dir():
        raise InputError(
            f"The export target is a directory. Received: {str(target)!r}. Give a file name, e.g. model.pt or "
            "model.safetensors."
        )
    if Path(newest.path).is_dir():
        model = read_whole(Path(newest.path))[1]  # whole tensors, read in this process alone
    else:
        model = load_checkpoint(newest.path)["model"]
    state = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in model.items()}
    if target.suffix == ".safetensors":
        from safetensors.torch import save

        payload = save(state)  # copies above: safetensors refuses tensors that share memory (tied weights)
        write_atomically(target, lambda handle: handle.write(payload))
    else:
        write_atomically(target, lambda handle: torch.save(state, handle))
    return Export(newest, [f for f in report.files if not f.ok and f.name not in MOVED_ASIDE])


def export_sharded(source: Path, target: Path) -> CheckpointFile:
    """Writes a plain model (a ``torch.save`` state_dict, or the model of the newest whole backup of `source`) as a
    sharded checkpoint directory `target` (``*.dcp``): ``dcp.load({"model": model.state_dict()}, checkpoint_id=target)``
    loads it into a model sharded at any number of ranks. Written in a partial directory, with a manifest of the
    files' sha256 (``stratagem checkpoint verify`` checks it), then renamed into place.

    Raises:
        InputError: `source` holds no model; `target` exists.
    """
    import torch.distributed.checkpoint as dcp

    if target.exists():
        raise InputError(
            f"The export target exists. Received: {str(target)!r}. Give a new directory name ending in .dcp."
        )
    state, used = _plain_model(source)
    partial = partial_directory(target, secrets.randbits(64))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)  # one process, on purpose
        dcp.save({"model": state}, checkpoint_id=partial, no_dist=True)
    files = [asdict(hash_file(p, 0)) for p in sorted(partial.iterdir())]
    epoch = None if used.epoch is None else used.epoch - 1  # stored from 0, as a sharded backup stores it
    manifest = {"format": FORMAT, "version": VERSION, "kind": "model", "step": used.step, "epoch": epoch}
    write_manifest(partial, {**manifest, "step_in_epoch": None, "strategy": None, "world_size": 1, "files": files})
    os.replace(partial, target)
    return used


def _plain_model(source: Path) -> tuple[dict[str, torch.Tensor], CheckpointFile]:
    if source.is_file():
        loaded = load_verified(source)
        if isinstance(loaded, dict) and loaded.get("format") is None:
            tensors = {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
            if tensors and len(tensors) == len(loaded):
                return tensors, CheckpointFile(source.name, str(source), source.stat().st_size, ok=True)
    report = inspect_backups(source)
    newest = _newest(report)
    if newest is None:
        raise InputError(
            f"No model to export in {str(source)!r}: neither a state_dict of tensors nor a whole backup. Received: "
            f"{[(f.name, f.error) for f in report.files]}. Point at a model file (torch.save(model.state_dict())) "
            "or a backup directory."
        )
    if Path(newest.path).is_dir():
        return read_whole(Path(newest.path))[1], newest
    return load_checkpoint(newest.path)["model"], newest
