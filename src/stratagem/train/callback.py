"""`Callback`, the base class of every `fit` callback: hooks around the run, its epochs and its steps.

The callbacks stratagem offers are in `stratagem.train.callbacks` (``sg.callbacks``), each built on this one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stratagem.train.fit_state import EpochLog, History, TrainingContext


class Callback:
    """Base class: override the hooks you need; each receives the run's `TrainingContext`.

    Hooks run on every worker (check ``context.is_chief`` for what only one process should do),
    in the order the callbacks were given, except that `BackupAndRestore` restores before the
    others begin and saves after the others ran for the step or epoch.

    Example:
        >>> class StopAtLoss(Callback):
        ...     def on_epoch_end(self, context, log):
        ...         context.stop_training = log.metrics["loss"] < 0.1
    """

    def on_train_begin(self, context: TrainingContext) -> None:
        """Before the first step (in a restored run, after `BackupAndRestore` restored it)."""

    def on_epoch_begin(self, context: TrainingContext) -> None:
        """At the start of epoch ``context.epoch`` (0-based), possibly mid-epoch after a restore."""

    def on_train_batch_end(self, context: TrainingContext, num_examples: int) -> None:
        """After each step; ``context.step`` steps are done, this one had `num_examples` global examples."""

    def on_epoch_end(self, context: TrainingContext, log: EpochLog) -> None:
        """After an epoch and its validation; `log` is also in ``context.history`` already."""

    def on_train_end(self, context: TrainingContext, history: History) -> None:
        """After training finished normally (not called when it raised)."""
