"""`BackupAndRestore`: the callback that backs a run up so that a restarted job resumes where the last backup left it.

It holds the backup directory (claimed by one job: `claim.py`; checked for room and permissions: `directory.py`),
writes a single-file backup on a thread (`writer.py`) or, under a sharded strategy, each rank's shards
(`sharded.py`), and restores from the newest whole one; `report.py` reads a directory back for
`stratagem checkpoint`.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stratagem import environ
from stratagem.errors import CorruptCheckpointError, InputError
from stratagem.trace.recorder import spanning
from stratagem.train.backup.claim import ClaimOwner, DirectoryClaim
from stratagem.train.backup.directory import CLUSTER_TOKEN, check_backup_directory, check_room_for_backups, job_id
from stratagem.train.backup.sharded import (
    read_backup,
    remove_stale_directories,
    save_sharded,
    save_sharded_async,
    weights_loader,
)
from stratagem.train.backup.writer import BackgroundWrite, snapshot
from stratagem.train.callback import Callback
from stratagem.train.checkpoint import (
    remove_stale_temporaries,
    save_checkpoint,
)
from stratagem.train.preemption import StopSignals

if TYPE_CHECKING:
    from stratagem.strategies.state_shards import StateShards
    from stratagem.train.fit_state import EpochLog, History, TrainingContext

logger = logging.getLogger(__name__)


class BackupAndRestore(Callback):
    """Backs the run up so that a restarted job resumes where the last backup left it, mid-epoch included.

    At the start of training, if `backup_dir` holds a backup, the model, optimizer, counters,
    random states and data position are restored from it (on every worker; the workers must see
    the same directory). Every backup is verified before it is used (the CRC32 of each member of
    its archive): a damaged one is refused with its name, and the run resumes from the previous
    backup instead when that one is whole. During training the chief alone writes a backup every
    `save_freq` steps or at the end of each epoch (``"epoch"``), atomically, keeping the one
    before it as ``backup.previous.pt`` unless ``keep_previous=False`` (two backups on disk
    instead of one). When training finishes, the backups are deleted (`delete_checkpoint`), so a
    later job starts afresh.

    Only files it names itself are ever removed: ``backup.pt``, ``backup.previous.pt``, and
    temporaries named ``.stratagem-partial.backup.pt.<16 hex digits>.tmp``; the directory goes
    only when this callback created it and nothing else is left in it.

    One job per directory: before it reads or removes anything there, the chief claims the
    directory (``.stratagem-claim``, locked for the job's life; see
    `stratagem.train.backup.claim`). A second job is refused with `sg.BackupDirectoryInUseError`
    naming the owner; the claim of an owner that no longer runs is taken over, logged, and kept in
    `took_over_from`. A directory that cannot hold the backups (a file, read-only, uncreatable, too
    little free space for three backups) is refused before the first step.

    While training, SIGTERM and SIGINT (``stop_on_signals``) stop every worker after the same step:
    the chief writes a backup and `fit` raises `sg.Preempted`, a ``SystemExit`` with code 143
    (SIGTERM) or 130 (SIGINT); rerunning the command resumes from that step. When the stop has not
    finished `grace_period` seconds after the signal, the process exits with that code at once,
    and the backups written before are whole (see `stratagem.train.preemption`).

    Under a strategy whose state is sharded (`ShardedStrategy`), every rank writes its own shards into
    ``backup.dcp/`` with a manifest of sha256 digests written last (`stratagem.train.backup.sharded`); a
    backup of either form resumes under any strategy and number of workers. ``async_save=True``: the
    state is copied at the step boundary and written on a thread while training goes on, keeping one
    more copy of it in memory: by the chief, a single-file backup (`stratagem.train.backup.writer`);
    under a sharded strategy, each rank its own shards (`stratagem.train.backup.sharded`).

    Example:
        >>> backup = sg.callbacks.BackupAndRestore("/shared/run1/backup", save_freq="epoch")
        >>> sg.fit(strategy, model, optimizer, loss, data, epochs=10, callbacks=[backup])
    """

    FILE_NAME = "backup.pt"
    PREVIOUS_NAME = "backup.previous.pt"
    CORRUPT_NAME = "backup.corrupt.pt"
    """Where the chief moves a damaged backup it fell back from, for the user to inspect or delete."""
    SHARDED_NAME = "backup.dcp"
    """Under a strategy whose state is sharded: a directory of every rank's shards (`stratagem.train.backup.sharded`)."""
    SHARDED_PREVIOUS_NAME = "backup.previous.dcp"
    CORRUPT_SHARDED_NAME = "backup.corrupt.dcp"
    MARKER_NAME = ".stratagem-backup-dir"
    """Written into `backup_dir` when this callback creates it: only such a directory is ever removed."""

    def __init__(
        self,
        backup_dir: str | os.PathLike[str],
        save_freq: str | int = "epoch",
        *,
        delete_checkpoint: bool = True,
        keep_previous: bool = True,
        stop_on_signals: bool = True,
        grace_period: float = 25.0,
        async_save: bool = False,
        allow_new_data_seed: bool = False,
    ) -> None:
        if isinstance(backup_dir, bool) or not isinstance(backup_dir, (str, os.PathLike)) or not str(backup_dir):
            raise InputError(f"backup_dir must be a directory path. Received: backup_dir={backup_dir!r}.")
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1):
            raise InputError(
                f"save_freq must be 'epoch' or a positive number of steps. Received: save_freq={save_freq!r}. "
                "Use e.g. save_freq=100."
            )
        self.backup_dir = Path(backup_dir)
        try:  # one look: another rank may create or rename the directory between two
            mode: int | None = os.stat(self.backup_dir).st_mode
        except OSError:
            mode = None  # absent (made at the first save), or not readable yet: the save says what is wrong
        if mode is not None and not stat.S_ISDIR(mode):
            raise InputError(
                f"backup_dir must be a directory. Received: backup_dir={str(backup_dir)!r}, which is a file. "
                "Choose a directory path."
            )
        if isinstance(grace_period, bool) or not isinstance(grace_period, (int, float)) or not grace_period > 0:
            raise InputError(
                f"grace_period must be a positive number of seconds. Received: grace_period={grace_period!r}. Use "
                "a little less than the scheduler's own (Kubernetes' terminationGracePeriodSeconds, 30 by default)."
            )
        self.save_freq = save_freq
        self._writes = BackgroundWrite() if async_save else None
        self._copy: Any = None
        self.allow_new_data_seed = allow_new_data_seed
        """Resume a backup taken with another data seed (with the backup's seed) instead of refusing it."""
        """async_save: each backup is written on a thread from a copy taken at the step boundary."""
        self.stop_signals = StopSignals(float(grace_period)) if stop_on_signals else None
        """While training, SIGTERM and SIGINT stop at the next step boundary with a backup (None: left alone)."""
        self.claim: DirectoryClaim | None = None
        """The chief's claim on `backup_dir` while training (`claim.took_over_from`: a dead owner replaced)."""
        self.took_over_from: ClaimOwner | None = None
        """The owner of the directory's claim that this run took over because it no longer ran, or None."""
        self._saved_step: int | None = None
        self._shards: StateShards | None = None
        self._damaged_sharded = False
        self.delete_checkpoint = delete_checkpoint
        self.keep_previous = keep_previous
        self.restored_from: dict[str, int] | None = None
        """``{"epoch", "step"}`` of the backup this run resumed from, or None for a fresh start."""
        self.restored_path: Path | None = None
        """The file this run resumed from (`path`, or `previous_path` after a fallback), or None."""

    @property
    def path(self) -> Path:
        return self.backup_dir / self.FILE_NAME

    @property
    def previous_path(self) -> Path:
        return self.backup_dir / self.PREVIOUS_NAME

    def check_directory(self) -> None:
        """Refuses a `backup_dir` that cannot hold backups (see `stratagem.train.backup.directory.check_backup_directory`)."""
        check_backup_directory(self.backup_dir)

    @property
    def sharded_path(self) -> Path:
        return self.backup_dir / self.SHARDED_NAME

    @property
    def sharded_previous_path(self) -> Path:
        return self.backup_dir / self.SHARDED_PREVIOUS_NAME

    def on_train_begin(self, context: TrainingContext) -> None:
        self._shards = context.strategy.state_shards()
        self._damaged_sharded = False
        self._saved_step = None
        if context.is_chief:
            self._make_directory()
            # Before anything is read or removed: a second job must not resume from, or clean up, a live job's files.
            self.claim = DirectoryClaim.acquire(self.backup_dir, job_id(environ.current().get(CLUSTER_TOKEN)))
            self.took_over_from = self.claim.took_over_from
            # Sharded: no model.state_dict() on the chief alone, whose FSDP hooks would reshard it out of step with
            # the other ranks; the parameters' global sizes are what the ranks write into the directory together.
            sizes = (
                context.state_dict()
                if self._shards is None
                else {"model": dict(context.model.named_parameters()), "optimizer": context.optimizer.state_dict()}
            )
            check_room_for_backups(self.backup_dir, sizes, self._backup_files(), files=3 if self.keep_previous else 2)
            # Only the claim's holder writes here, so a temporary left is one a dead owner did not finish.
            remove_stale_temporaries(self.backup_dir, self.FILE_NAME)
            remove_stale_directories(self.backup_dir, self._sharded_names)
        if self.stop_signals is not None:
            self.stop_signals.install()
        found = self._load_newest_whole_backup(context)
        if found is None:
            return
        path, state, load_weights = found
        try:
            context.load_state_dict(state, load_weights=load_weights, allow_new_data_seed=self.allow_new_data_seed)
        except InputError as error:
            raise InputError(f"Cannot resume from the backup {str(path)!r}: {error}") from error
        self.restored_from = {"epoch": context.epoch, "step": context.step}
        self.restored_path = path
        logger.info(
            "Resumed from %s: epoch %d, step %d (%d into the epoch).",
            path,
            context.epoch + 1,
            context.step,
            context.step_in_epoch,
        )

    def _load_newest_whole_backup(self, context: TrainingContext) -> tuple[Path, dict[str, Any], Any] | None:
        """The whole backup of the latest step (its state, and how to load its tensors when they are not in it:
        a sharded backup, or a whole one into a sharded model), or None when there is none; damaged ones are
        refused. Both forms are read, so a run resumes from what a run of another strategy wrote."""
        damaged: list[tuple[Path, CorruptCheckpointError]] = []
        whole: list[tuple[int, Path, dict[str, Any], Any]] = []
        for candidate in (self.sharded_path, self.path, self.sharded_previous_path, self.previous_path):
            if not candidate.exists():
                continue  # killed between the two renames of a save: the previous backup is the newest
            try:
                step, state = read_backup(candidate)
            except CorruptCheckpointError as error:
                damaged.append((candidate, error))
                continue
            except InputError:
                if not candidate.exists():  # the chief moved a damaged file aside while this worker looked
                    continue
                raise
            whole.append((step, candidate, state, weights_loader(self._shards, context, candidate, state)))
        if whole:
            step, chosen, state, load_weights = max(whole, key=lambda found: found[0])  # the first of a tie
            if damaged:
                which = "previous backup" if chosen in (self.previous_path, self.sharded_previous_path) else "backup"
                logger.warning("%s Resuming from the %s %s instead.", damaged[0][1], which, chosen)
                self._set_damaged_aside(context.is_chief, [path for path, _ in damaged])
            return chosen, state, load_weights
        if damaged:
            kept = (
                ""
                if self.previous_path.is_file() or self.sharded_previous_path.is_dir()
                else f" (and there is no previous backup {str(self.previous_path)!r})"
            )
            raise CorruptCheckpointError(
                " ".join(str(error) for _, error in damaged)
                + f" No whole backup is left to resume from{kept}. Received: backup_dir={str(self.backup_dir)!r}. "
                "Remove the damaged file(s) to start afresh, or restore them from a copy."
            )
        return None

    def _set_damaged_aside(self, is_chief: bool, damaged: list[Path]) -> None:
        """Damaged newest backups out of the way of the next save, which would keep them as the previous backup."""
        if self.path in damaged and is_chief:
            os.replace(self.path, self.backup_dir / self.CORRUPT_NAME)
            logger.warning(
                "The damaged backup was moved to %s; delete it once inspected.", self.backup_dir / self.CORRUPT_NAME
            )
        # Other ranks may still be reading it now: the chief moves it at its first save, after a collective step.
        self._damaged_sharded = self.sharded_path in damaged

    def _make_directory(self) -> None:
        if self.backup_dir.is_dir():
            return
        check_backup_directory(self.backup_dir)
        self.backup_dir.mkdir(parents=True, exist_ok=True)
        (self.backup_dir / self.MARKER_NAME).touch()  # a later attempt of this job knows it may remove the directory

    @property
    def _sharded_names(self) -> tuple[str, ...]:
        return (self.SHARDED_NAME, self.SHARDED_PREVIOUS_NAME)

    def _backup_files(self) -> list[Path]:
        return [p for p in (self.path, self.previous_path) if p.is_file()]

    def on_train_batch_end(self, context: TrainingContext, num_examples: int) -> None:
        if isinstance(self.save_freq, int) and context.step % self.save_freq == 0:
            self._save(context)

    def on_epoch_end(self, context: TrainingContext, log: EpochLog) -> None:
        if self.save_freq == "epoch":
            self._save(context)

    def on_train_end(self, context: TrainingContext, history: History) -> None:
        try:
            if self._writes is not None:
                self._writes.wait()
            if context.is_chief and self.delete_checkpoint:
                self._delete_backups()
        finally:
            self.close()

    def close(self) -> None:
        """Gives the signals back to their handlers and the directory up; `fit` calls it when training fails."""
        if self.stop_signals is not None:
            self.stop_signals.uninstall()
        if self._writes is not None:
            try:
                self._writes.wait()  # no write may outlive the claim, nor the buffers it reads
            except Exception as error:  # noqa: BLE001 - training already failed or ended; this one is logged
                logger.warning("The last background backup write failed: %s", error)
            if self._shards is not None and self._writes.idle:
                self._shards.close()
        if self.claim is not None:
            self.claim.release()
            self.claim = None

    def _delete_backups(self) -> None:
        self.path.unlink(missing_ok=True)
        self.previous_path.unlink(missing_ok=True)
        remove_stale_temporaries(self.backup_dir, self.FILE_NAME)
        for directory in (self.sharded_path, self.sharded_previous_path):
            shutil.rmtree(directory, ignore_errors=True)
        remove_stale_directories(self.backup_dir, self._sharded_names)
        self.close()  # the claim file goes too, so the directory may be empty now
        marker = self.backup_dir / self.MARKER_NAME
        try:
            left = {entry.name for entry in self.backup_dir.iterdir()}
        except OSError:
            return
        if left == {self.MARKER_NAME}:  # created by this callback, and nothing of anyone else's in it
            marker.unlink(missing_ok=True)
            try:
                self.backup_dir.rmdir()
            except OSError:  # a file appeared meanwhile: it stays, and so does the directory
                pass

    def _save(self, context: TrainingContext) -> None:
        # The save's time on the training thread (a copy, or the whole write without a thread), in the trace.
        with spanning(context.recorder, "backup", f"backup of step {context.step}"):
            self._save_now(context)

    def _save_now(self, context: TrainingContext) -> None:
        if self._shards is not None:
            self._save_sharded(context, self._shards)
            return
        # Only the chief builds and writes the state: one writer, and every worker holds the same values.
        if context.is_chief:
            previous = self.previous_path if self.keep_previous else None
            if self._writes is None:
                save_checkpoint(self.path, context.state_dict(), previous=previous)
            else:
                self._writes.wait()  # the copy before is free again (and its write's error raised here)
                # The step boundary's values, into the buffers of the copy before; training goes on meanwhile.
                state = self._copy = snapshot(context.state_dict(), self._copy)
                self._writes.start(lambda: save_checkpoint(self.path, state, previous=previous), str(self.path))
        self._saved_step = context.step

    def _save_sharded(self, context: TrainingContext, shards: StateShards) -> None:
        # Every rank writes its own shards; the chief adds the rest of the state and the manifest, last.
        if context.is_chief and self._damaged_sharded:
            corrupt = self.backup_dir / self.CORRUPT_SHARDED_NAME
            shutil.rmtree(corrupt, ignore_errors=True)
            os.replace(self.sharded_path, corrupt)
            logger.warning("The damaged sharded backup was moved to %s; delete it once inspected.", corrupt)
        self._damaged_sharded = False
        where: dict[str, Any] = {
            "step": context.step,
            "is_chief": context.is_chief,
            "previous": self.sharded_previous_path if self.keep_previous else None,
        }
        if self._writes is None:
            state = context.state_dict(weights=False) if context.is_chief else {}
            save_sharded(self.sharded_path, shards, context.model, context.optimizer, state, **where)
        else:
            self._writes.wait()  # the stager's buffers are free again (and the write's error raised here)
            # The step boundary's values: the chief's state copied (containers too), the shards by save_async.
            state = snapshot(context.state_dict(weights=False)) if context.is_chief else {}
            write = save_sharded_async(self.sharded_path, shards, context.model, context.optimizer, state, **where)
            self._writes.start(write, str(self.sharded_path))
        self._saved_step = context.step

    def save_on_stop(self, context: TrainingContext) -> None:
        """Writes a backup of the step just done, unless the last save was of that step (`fit` calls it on a signal)."""
        if self._saved_step != context.step:
            self._save(context)
        if self._writes is not None:
            self._writes.wait()  # on disk before the process exits
