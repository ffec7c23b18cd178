"""Sharded backups: a directory per checkpoint, every rank's shards checksummed, a manifest written last.

Under a strategy whose state is sharded (`Strategy.state_shards()` is not None), `BackupAndRestore` writes
``backup.dcp/`` instead of ``backup.pt``::

    backup.dcp/
      __0_0.distcp, __1_0.distcp, ...   each rank's shards (torch.distributed.checkpoint)
      .metadata                          DCP's index of the shards (written by rank 0)
      state.pt                           the chief's counters, random states, data position, history,
                                         callbacks and the optimizer's hyper-parameters (save_checkpoint)
      manifest.json                      written last: step, epoch, strategy, world size, data position,
                                         and the sha256, size and writing rank of every file above

Every rank writes into ``.stratagem-partial.backup.dcp.<step, 16 hex digits>.tmp/``; once every rank's
digests are in, the chief writes ``state.pt``, then the manifest (a temporary renamed over it), then
renames the newest directory to ``backup.previous.dcp`` and the new one to ``backup.dcp``. A directory
without its manifest is never renamed into place, so a crash during any write leaves the backups before
it as they were. With ``async_save=True`` (`save_sharded_async`) training waits only while every rank copies
its shards; each rank's writer thread writes them, the ranks' writer threads agree on the digests on a process
group of their own, and the chief's writes the state and the manifest, then renames, all while training goes on.
Before the first step every file is read and compared with its digest: a flipped byte
in a shard, the metadata or the state is refused, naming the file and the rank that wrote it, and the
previous backup is used.

`read_whole` reads a sharded backup into whole tensors (no process group), so a run of one process, or
of processes that each hold the whole state, resumes from it; `BackupAndRestore` also resumes a sharded
run from a single-file backup (`StateShards.load_whole`). DCP's ``.metadata`` is a pickle, which
``dcp.load`` unpickles: the digest check stops accidental damage, not someone who can write the directory.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stratagem.errors import CorruptCheckpointError
from stratagem.strategies.state_shards import hash_file
from stratagem.train.checkpoint import fsync_directory, load_checkpoint, save_checkpoint, write_error

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn

    from stratagem.strategies.state_shards import ShardFile, StateShards
    from stratagem.train.fit_state import TrainingContext

FORMAT = "stratagem-sharded-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
STATE = "state.pt"
_PARTIAL = re.compile(r"\A\.stratagem-partial\.(?P<name>.+)\.[0-9a-f]{16}\.tmp\Z")


def partial_directory(final: Path, step: int) -> Path:
    """Where every rank writes the checkpoint of `step` before it is complete (the same name on every rank)."""
    return final.parent / f".stratagem-partial.{final.name}.{step % (1 << 64):016x}.tmp"


def save_sharded(
    final: Path,
    shards: StateShards,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    *,
    step: int,
    is_chief: bool,
    previous: Path | None,
) -> None:
    """Every rank writes its shards; the chief then writes `state`, the manifest, and moves the result into place.

    `state` is the chief's part (`TrainingContext.state_dict(weights=False)` and the optimizer's
    ``param_groups``); `previous`: where the checkpoint `final` held is kept (None: it is removed).
    """
    partial = partial_directory(final, step)
    finish_sharded(partial, final, shards.save(partial, model, optimizer), state, is_chief=is_chief, previous=previous)


def save_sharded_async(
    final: Path,
    shards: StateShards,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    *,
    step: int,
    is_chief: bool,
    previous: Path | None,
) -> Callable[[], None]:
    """`save_sharded` in two parts: this rank's shards copied now (every rank after the same step), and the
    function that does the rest (for a writer thread): the write, the digests every rank learns, and on the chief
    `state` (which must not change meanwhile: a copy), the manifest and the renames, once every rank's files are in."""
    partial = partial_directory(final, step)
    write = shards.save_async(partial, model, optimizer)
    return lambda: finish_sharded(partial, final, write(), state, is_chief=is_chief, previous=previous)


def finish_sharded(
    partial: Path, final: Path, files: list[ShardFile], state: dict[str, Any], *, is_chief: bool, previous: Path | None
) -> None:
    """After every rank's shards are in `partial` (`files`): the chief writes `state` and the manifest, last, and
    moves `partial` into place as `final`; the other ranks have nothing left to do."""
    if not is_chief:
        return
    try:
        save_checkpoint(partial / STATE, state)
        files.append(hash_file(partial / STATE, 0))
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "step": int(state["step"]),
            "epoch": int(state["epoch"]),
            "step_in_epoch": int(state["step_in_epoch"]),
            "strategy": state.get("strategy"),
            "world_size": int(state.get("num_processes", 1)),
            "files": [asdict(f) for f in files],
        }
        write_manifest(partial, manifest)
    except Exception as error:
        shutil.rmtree(partial, ignore_errors=True)
        raise error if isinstance(error, OSError) else write_error(partial, error, 0) from error
    _move_into_place(partial, final, previous)


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    temporary = directory / f".{MANIFEST}.{secrets.token_hex(8)}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, directory / MANIFEST)
    fsync_directory(directory)


def _move_into_place(partial: Path, final: Path, previous: Path | None) -> None:
    """The renames, each atomic: killed between two of them, the newest whole checkpoint is still on disk."""
    trash: list[Path] = []
    if final.exists():
        if previous is not None:
            if previous.exists():
                trash.append(_aside(previous))
            os.replace(final, previous)  # killed right after: `previous` is the newest whole checkpoint
        else:
            trash.append(_aside(final))
    os.replace(partial, final)
    fsync_directory(final.parent)
    for directory in trash:
        shutil.rmtree(directory, ignore_errors=True)


def _aside(directory: Path) -> Path:
    """Renames `directory` to a partial name (so it never loads, and a later start removes what is left of it)."""
    target = directory.parent / f".stratagem-partial.{directory.name}.{secrets.token_hex(8)}.tmp"
    os.replace(directory, target)
    return target


def remove_stale_directories(directory: Path, names: tuple[str, ...]) -> list[Path]:
    """Deletes partial checkpoint directories of `names` that a killed job left (only this module's own names)."""
    removed = []
    if directory.is_dir():
        for entry in directory.iterdir():
            match = _PARTIAL.match(entry.name)
            if match and match.group("name") in names and entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return sorted(removed)


def verify_sharded(directory: Path) -> dict[str, Any]:
    """Reads every file the manifest of `directory` lists and compares its size and sha256; returns the manifest.

    Raises:
        CorruptCheckpointError: the manifest is missing or unreadable, or a file is missing, of another size,
            or of another digest; the message names the file and the rank that wrote it.
    """
    manifest = read_manifest(directory)
    for entry in manifest["files"]:
        path = directory / entry["name"]
        who = f"written by rank {entry['rank']}"
        if not path.is_file():
            raise _damaged(directory, f"its file {entry['name']!r} ({who}) is missing", "a checkpoint with a file lost")
        found = hash_file(path, int(entry["rank"]))
        if found.num_bytes != entry["num_bytes"] or found.sha256 != entry["sha256"]:
            raise _damaged(
                directory,
                f"its file {entry['name']!r} ({who}) differs from what was written (sha256 {found.sha256[:16]}... "
                f"and {found.num_bytes} bytes, the manifest says {entry['sha256'][:16]}... and {entry['num_bytes']})",
                "a file whose bytes changed after the save",
            )
    return manifest


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a sharded checkpoint directory, its shape checked (the files themselves are not read)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _damaged(directory, f"it has no {MANIFEST}", "a directory whose save never finished") from None
    except (OSError, ValueError) as error:
        raise _damaged(directory, f"its {MANIFEST} cannot be read ({error})", "a damaged manifest") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("files"), list)
    ):
        raise _damaged(directory, f"its {MANIFEST} is not a stratagem manifest", "a manifest of another shape")
    return manifest


def read_whole(directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """A verified sharded checkpoint as whole tensors, in this process alone: (state, model, optimizer) where the
    optimizer is in ``Optimizer.state_dict``'s form (parameters numbered). For a run whose processes each hold
    the whole model, and for `stratagem checkpoint export`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state = load_checkpoint(directory / STATE)
    tensors: dict[str, Any] = {}
    # As torch's own dcp_to_torch_save reads one: the public dcp.load fills only the keys it is given.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)  # no process group, on purpose
        _load_state_dict(
            tensors, storage_reader=FileSystemReader(directory), planner=_EmptyStateDictLoadPlanner(), no_dist=True
        )
    positions = tensors.get("optimizer", {})
    optimizer = {
        "state": {int(i): dict(entry) for i, entry in positions.items()},
        "param_groups": state["optimizer_param_groups"],
    }
    return state, dict(tensors.get("model", {})), optimizer


def read_backup(path: Path) -> tuple[int, dict[str, Any]]:
    """(step, state) of a verified backup, single-file or sharded (whose state holds no model or optimizer).

    Raises:
        CorruptCheckpointError: a checksum or digest differs, a file is missing, or the manifest is unreadable.
    """
    if path.is_dir():
        manifest = verify_sharded(path)
        return int(manifest["step"]), load_checkpoint(path / STATE)
    state = load_checkpoint(path)
    return int(state.get("step", -1)), state


def weights_loader(
    shards: StateShards | None, context: TrainingContext, path: Path, state: dict[str, Any]
) -> Callable[[], None] | None:
    """None when `state` holds the model and optimizer as this run loads them; else the function that loads
    them: this rank's shards of a sharded backup, a sharded backup as whole tensors, or a whole one cut into shards."""
    model, optimizer = context.model, context.optimizer
    if path.is_dir() and shards is not None:
        return lambda: shards.load(path, model, optimizer, state["optimizer_param_groups"])
    if path.is_dir():

        def load_whole_tensors() -> None:
            _, model_state, optimizer_state = read_whole(path)
            model.load_state_dict(model_state)
            optimizer.load_state_dict(optimizer_state)

        return load_whole_tensors
    if shards is not None and "model" in state and "optimizer" in state:
        return lambda: shards.load_whole(state["model"], state["optimizer"], model, optimizer)
    return None


def files_by_rank(manifest: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for entry in manifest["files"]:
        out.setdefault(int(entry["rank"]), []).append(entry)
    return dict(sorted(out.items()))


def _damaged(directory: Path, reason: str, received: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"The sharded checkpoint {str(directory)!r} is damaged: {reason}. Received: {received}. Restore it from a "
        "copy, or remove it to start afresh; if it was written whole, check the disk or file system that holds it."
    )
