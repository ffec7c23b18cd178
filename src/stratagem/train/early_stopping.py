"""`EarlyStopping`: stop `fit` when a monitored metric has stopped improving.

The metrics of an epoch are summed over every replica and worker before they are read, so every
worker sees the same value and stops at the same epoch: the workers stay in step without talking.

Example:
    >>> stop = sg.callbacks.EarlyStopping(monitor="val_loss", patience=3, restore_best_weights=True)
    >>> sg.fit(strategy, net, optimizer, F.cross_entropy, data, epochs=100, validation_data=val, callbacks=[stop])
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch

from stratagem.errors import InputError
from stratagem.train.callback import Callback

if TYPE_CHECKING:
    from stratagem.train.fit_state import EpochLog, History, TrainingContext

logger = logging.getLogger(__name__)


def resolve_mode(mode: str, monitor: str) -> str:
    """ "min" or "max" for `monitor`; "auto" takes "max" for accuracies, "min" for everything else."""
    if mode not in ("auto", "min", "max"):
        raise InputError(f"mode must be 'auto', 'min' or 'max'. Received: mode={mode!r}.")
    if mode == "auto":
        return "max" if monitor.endswith("accuracy") else "min"
    return mode


def monitored_value(log: EpochLog, monitor: str, who: str) -> float:
    """The value of `monitor` in an epoch's log, or an error listing the metrics there are."""
    if monitor not in log.metrics:
        raise InputError(
            f"{who} monitors {monitor!r}, which this run does not measure. Received: monitor={monitor!r}; the "
            f"epoch measured {sorted(log.metrics)}. Monitor one of those (val_ metrics need validation_data)."
        )
    return float(log.metrics[monitor])


class EarlyStopping(Callback):
    """Stops training once `monitor` has not improved by more than `min_delta` for `patience` epochs.

    Args:
        monitor: a metric of the epoch log: ``"loss"``, ``"val_loss"``, ``"val_accuracy"``...
        patience: epochs without improvement to allow before stopping (0: stop at the first one).
        min_delta: the smallest change that counts as an improvement.
        mode: ``"min"``, ``"max"``, or ``"auto"`` (max for accuracies, else min).
        restore_best_weights: at the end of training, put back the weights of the best epoch
            (on every replica and worker), whether training stopped early or ran every epoch.

    After training, ``stopped_epoch`` is the 1-based epoch after which it stopped (0: it did not),
    ``best`` the best value and ``best_epoch`` its epoch.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        *,
        patience: int = 0,
        min_delta: float = 0.0,
        mode: str = "auto",
        restore_best_weights: bool = False,
    ) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise InputError(f"monitor must be a metric name. Received: monitor={monitor!r}. Use e.g. 'val_loss'.")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise InputError(f"patience must be a whole number of epochs, 0 or more. Received: patience={patience!r}.")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or min_delta < 0:
            raise InputError(f"min_delta must be a number, 0 or more. Received: min_delta={min_delta!r}.")
        self.monitor = monitor
        self.patience = patience
        self.min_delta = float(min_delta)
        self.mode = resolve_mode(mode, monitor)
        self.restore_best_weights = restore_best_weights
        self.best = math.inf if self.mode == "min" else -math.inf
        self.best_epoch = 0
        self.wait = 0
        self.stopped_epoch = 0
        self._best_weights: dict[str, torch.Tensor] | None = None

    def _improved(self, value: float) -> bool:
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_epoch_end(self, context: TrainingContext, log: EpochLog) -> None:
        value = monitored_value(log, self.monitor, "EarlyStopping")
        if self._improved(value):
            self.best, self.best_epoch, self.wait = value, log.epoch, 0
            if self.restore_best_weights:
                self._best_weights = {k: v.detach().to("cpu", copy=True) for k, v in context.model.state_dict().items()}
            return
        self.wait += 1
        if self.wait > self.patience:
            self.stopped_epoch = log.epoch
            context.stop_training = True
            logger.info(
                "EarlyStopping: %s has not improved on %.6g (epoch %d) for %d epoch(s); stopping after epoch %d.",
                self.monitor,
                self.best,
                self.best_epoch,
                self.wait,
                log.epoch,
            )

    def on_train_end(self, context: TrainingContext, history: History) -> None:
        if self.restore_best_weights and self._best_weights is not None:
            context.model.load_state_dict(self._best_weights)
            logger.info(
                "EarlyStopping: restored the weights of epoch %d (%s %.6g).", self.best_epoch, self.monitor, self.best
            )

    # A backup carries the count so far (and the best weights), so a restarted run stops where this one would.
    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "best_epoch": self.best_epoch,
            "wait": self.wait,
            "stopped_epoch": self.stopped_epoch,
            "best_weights": self._best_weights,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_epoch = float(state["best"]), int(state["best_epoch"])
        self.wait, self.stopped_epoch = int(state["wait"]), int(state["stopped_epoch"])
        self._best_weights = state["best_weights"]
