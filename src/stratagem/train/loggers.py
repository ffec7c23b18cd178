"""Loggers of `fit`: `CSVLogger` (one row per epoch) and `TensorBoard` (through torch.utils.tensorboard).

Both write on the chief only, so a multi-worker job keeps one log, not one per worker.

Example:
    >>> sg.fit(strategy, net, optimizer, F.cross_entropy, data, epochs=10,
    ...        callbacks=[sg.callbacks.CSVLogger("run/log.csv"), sg.callbacks.TensorBoard("run/tb")])
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stratagem.errors import InputError
from stratagem.train.callback import Callback

if TYPE_CHECKING:
    from stratagem.train.fit_state import EpochLog, History, TrainingContext


def _check_path(value: Any, name: str, example: str) -> Path:
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)) or not str(value):
        raise InputError(f"{name} must be a path. Received: {name}={value!r}. Use e.g. {name}={example!r}.")
    return Path(value)


class CSVLogger(Callback):
    """Appends one row per epoch to a CSV file on the chief: ``epoch``, then every metric of the epoch log,
    then ``num_examples`` and ``elapsed_s``.

    Args:
        filename: the CSV file (its directory is created).
        separator: the field separator.
        append: keep the rows already in the file (a resumed run) instead of starting it afresh.
    """

    def __init__(self, filename: str | os.PathLike[str], *, separator: str = ",", append: bool = False) -> None:
        self.filename = _check_path(filename, "filename", "run/log.csv")
        if not isinstance(separator, str) or len(separator) != 1:
            raise InputError(f"separator must be one character. Received: separator={separator!r}.")
        self.separator = separator
        self.append = append
        self._columns: list[str] | None = None

    def on_train_begin(self, context: TrainingContext) -> None:
        self._columns = None
        if context.is_chief:
            self.filename.parent.mkdir(parents=True, exist_ok=True)
            if self.append and self.filename.exists() and self.filename.stat().st_size > 0:
                with self.filename.open(newline="") as handle:
                    self._columns = next(csv.reader(handle, delimiter=self.separator), None)
            else:
                self.filename.write_text("")

    def on_epoch_end(self, context: TrainingContext, log: EpochLog) -> None:
        if not context.is_chief:
            return
        row = {"epoch": log.epoch, **log.metrics, "num_examples": log.num_examples, "elapsed_s": log.elapsed_s}
        with self.filename.open("a", newline="") as handle:
            if self._columns is None:
                self._columns = list(row)
                csv.writer(handle, delimiter=self.separator).writerow(self._columns)
            # A metric missing from this epoch (validation every other epoch) leaves its cell empty.
            csv.DictWriter(handle, self._columns, delimiter=self.separator, extrasaction="ignore").writerow(row)


class TensorBoard(Callback):
    """Writes every epoch's metrics as TensorBoard scalars on the chief (``epoch_loss``, ``epoch_val_loss``...),
    and with ``update_freq=N`` the running training metrics every N steps (``batch_loss``...).

    Needs the optional ``tensorboard`` package (torch.utils.tensorboard writes through it).

    Args:
        log_dir: the directory of the event files.
        update_freq: ``"epoch"``, or a number of steps between running-metric points.
    """

    def __init__(self, log_dir: str | os.PathLike[str] = "logs", *, update_freq: str | int = "epoch") -> None:
        self.log_dir = _check_path(log_dir, "log_dir", "run/tb")
        if update_freq != "epoch" and (
            isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1
        ):
            raise InputError(
                f"update_freq must be 'epoch' or a positive number of steps. Received: "
                f"update_freq={update_freq!r}. Use e.g. update_freq=100."
            )
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise InputError(
                "The TensorBoard callback needs the tensorboard package, which is not installed. Received: "
                "TensorBoard(...) without it. Install it (pip install tensorboard), or log with CSVLogger."
            ) from None
        self._writer_class = SummaryWriter
        self.update_freq = update_freq
        self._writer: Any = None

    def on_train_begin(self, context: TrainingContext) -> None:
        if context.is_chief and self._writer is None:
            self._writer = self._writer_class(log_dir=str(self.log_dir))

    def on_train_batch_end(self, context: TrainingContext, num_examples: int) -> None:
        # update_freq is "epoch" or a whole number of steps (checked in __init__).
        if self._writer is not None and isinstance(self.update_freq, int) and context.step % self.update_freq == 0:
            for name, value in context.running_metrics().items():
                self._writer.add_scalar(f"batch_{name}", value, context.step)

    def on_epoch_end(self, context: TrainingContext, log: EpochLog) -> None:
        if self._writer is not None:
            for name, value in log.metrics.items():
                self._writer.add_scalar(f"epoch_{name}", value, log.epoch)
            self._writer.flush()

    def on_train_end(self, context: TrainingContext, history: History) -> None:
        self.close()

    def close(self) -> None:
        """Flushes and closes the event file; also called when training fails."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
