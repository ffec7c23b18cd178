"""Callbacks of `fit`: hooks around epochs and steps, backups for restarts, a progress bar.

A callback receives the `TrainingContext` of the run (strategy, model, optimizer, counters,
chief or not); `BackupAndRestore` uses its ``state_dict``/``load_state_dict`` to save and
restore everything a run needs to continue exactly.

Its members are every callback: `Callback` (the base class, in `stratagem.train.callback`),
`LearningRateScheduler` (here), `BackupAndRestore` (`stratagem.train.backup`), `ProgressBar`, `EarlyStopping`,
`ModelCheckpoint`, `CSVLogger` and `TensorBoard` (each in a module of its own).

Example:
    >>> history = sg.fit(strategy, model, optimizer, F.cross_entropy, data, epochs=5,
    ...                  callbacks=[sg.callbacks.BackupAndRestore("/tmp/backup", save_freq=100)])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stratagem.errors import InputError
from stratagem.strategies import lr_schedulers
from stratagem.train.backup.callback import BackupAndRestore
from stratagem.train.callback import Callback

# The callbacks that live in modules of their own, here too so that sg.callbacks lists every callback.
from stratagem.train.early_stopping import EarlyStopping
from stratagem.train.loggers import CSVLogger, TensorBoard
from stratagem.train.model_checkpoint import ModelCheckpoint
from stratagem.train.progress_bar import ProgressBar, format_epoch_line

if TYPE_CHECKING:
    from stratagem.train.fit_state import EpochLog, TrainingContext


class LearningRateScheduler(Callback):
    """Steps a torch LR scheduler after every epoch (``interval="epoch"``) or step; its state travels in backups.

    Build the scheduler on the optimizer given to `fit` (or to `strategy.distribute`), or on the one
    `strategy.distribute` returned; either way it steps once per global step.

    Example:
        >>> model, optimizer = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1))
        >>> schedule = sg.callbacks.LearningRateScheduler(torch.optim.lr_scheduler.StepLR(optimizer, 2))
        >>> sg.fit(strategy, model, optimizer, loss, data, epochs=6, callbacks=[backup, schedule])
    """

    def __init__(self, scheduler: Any, interval: str = "epoch") -> None:
        if not (callable(getattr(scheduler, "step", None)) and hasattr(scheduler, "optimizer")):
            raise InputError(
                f"LearningRateScheduler needs a torch.optim.lr_scheduler scheduler. "
                f"Received: {type(scheduler).__name__}. Use e.g. torch.optim.lr_scheduler.StepLR(optimizer, 10)."
            )
        if interval not in ("epoch", "step"):
            raise InputError(f"interval must be 'epoch' or 'step'. Received: interval={interval!r}.")
        self.scheduler = scheduler
        self.interval = interval

    def on_train_begin(self, context: TrainingContext) -> None:
        if not lr_schedulers.drives(self.scheduler, context.optimizer):
            raise InputError(
                "The scheduler adjusts an optimizer that fit does not train with. Received: a scheduler of "
                f"{type(self.scheduler.optimizer).__name__}, fit trains with {type(context.optimizer).__name__}. Build "
                "the scheduler on the optimizer strategy.distribute returned, and pass that pair to fit."
            )

    def on_train_batch_end(self, context: TrainingContext, num_examples: int) -> None:
        if self.interval == "step":
            self.scheduler.step()

    def on_epoch_end(self, context: TrainingContext, log: EpochLog) -> None:
        if self.interval == "epoch":
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


__all__ = [
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "EarlyStopping",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "ProgressBar",
    "TensorBoard",
    "format_epoch_line",
]
