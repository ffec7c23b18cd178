"""The state of a `fit` run and its records: what callbacks see, what a backup holds, what an epoch measured.

`TrainingContext` is the run's state (model, optimizer, data, counters, the epoch's metric sums,
the history); its ``state_dict``/``load_state_dict`` are what `BackupAndRestore` saves and restores,
and a backup whose kind, fields, metrics or stateful callbacks differ from the run's is refused
before it is loaded. `EpochLog` is one epoch's figures, `History` what `fit` returns. The loop that
moves this state on is `stratagem.train.fit`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stratagem.errors import InputError
from stratagem.strategies.base import Strategy
from stratagem.train.checkpoint import capture_rng_state, restore_rng_state
from stratagem.train.metrics import MetricSet

if TYPE_CHECKING:
    from stratagem.train.tracing import FitTrace

# Written into every backup, so that a checkpoint something else wrote is refused by its kind.
CHECKPOINT_KIND = "fit"


@dataclass(frozen=True)
class EpochLog:
    """What one epoch measured: metrics over every example it trained on, then validation ones."""

    epoch: int
    """1-based epoch number."""
    metrics: dict[str, float]
    """``loss``, the metrics, then ``val_loss`` and ``val_<metric>`` when there is validation data.
    The training metrics are computed during the epoch, each step's before its update."""
    num_examples: int
    elapsed_s: float
    """Wall time of the epoch's training steps (no validation); after a restore, of the steps since."""

    @property
    def samples_per_s(self) -> float:
        return self.num_examples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "metrics": dict(self.metrics),
            "num_examples": self.num_examples,
            "elapsed_s": self.elapsed_s,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EpochLog:
        return cls(
            int(data["epoch"]),
            {k: float(v) for k, v in data["metrics"].items()},
            int(data["num_examples"]),
            float(data["elapsed_s"]),
        )


@dataclass
class History:
    """What `fit` returns: one `EpochLog` per epoch and the distributed model and optimizer it trained."""

    epochs: list[EpochLog]
    model: nn.Module = field(repr=False)
    """The model `strategy.distribute` returned; pass it to `evaluate` or to another `fit`."""
    optimizer: torch.optim.Optimizer = field(repr=False)
    trace: FitTrace | None = field(default=None, repr=False)
    """Where this worker's steps went, from the trace `fit` leaves on (`trace=True`, the default: summary mode, a
    sample of the steps; `print(history.trace.text())`); None with `trace=False`, `trace=DIR` (the files in DIR
    hold it) or a strategy that does not sample its steps (docs/trace.md)."""

    @property
    def history(self) -> dict[str, list[float]]:
        """Keras' shape: ``{"loss": [epoch 1, epoch 2, ...], "accuracy": [...], ...}``."""
        out: dict[str, list[float]] = {}
        for log in self.epochs:
            for name, value in log.metrics.items():
                out.setdefault(name, []).append(value)
        return out


@dataclass
class TrainingContext:
    """The state of a `fit` run that callbacks see and that a backup saves and restores."""

    strategy: Strategy
    model: nn.Module
    optimizer: torch.optim.Optimizer
    data: Any
    """The training data source (a `ShuffledBatches` when `fit` was given a data set and a batch size)."""
    epochs: int
    steps_per_epoch: int | None
    is_chief: bool
    metric_set: MetricSet
    epoch: int = 0
    """0-based epoch in progress (the next one, once an epoch has ended)."""
    step: int = 0
    """Steps done since training began, across epochs and restarts."""
    step_in_epoch: int = 0
    """Batches of the current epoch already trained on: where the data resumes."""
    totals: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    """The current epoch's metric states summed so far (loss * examples, examples, metric sums)."""
    epoch_elapsed_s: float = 0.0
    history: list[EpochLog] = field(default_factory=list)
    stop_training: bool = False
    """Set by a callback to stop after the current step."""
    callbacks: list[Any] = field(default_factory=list)
    """The run's callbacks (each a `stratagem.train.Callback`, checked by `fit`; not named here, since callback.py
    names this module's types); those with ``state_dict``/``load_state_dict`` travel in backups."""
    recorder: Any = None
    """The trace's recorder while `fit(trace=DIR)` records (a `stratagem.trace.Recorder`), else None: a callback's
    own work on the training thread (a backup's save) becomes a span of it."""

    @property
    def examples_per_epoch(self) -> int | None:
        """Examples in one epoch when the data says (``num_examples`` or a ``dataset``), else None."""
        num = getattr(self.data, "num_examples", None)
        if num is None and hasattr(getattr(self.data, "dataset", None), "__len__"):
            num = len(self.data.dataset)
        return num if self.steps_per_epoch is None else None

    def running_metrics(self) -> dict[str, float]:
        """The current epoch's metrics so far."""
        return self.metric_set.results(self.totals)

    def state_dict(self, *, weights: bool = True) -> dict[str, Any]:
        """Everything needed to continue exactly: parameters, buffers, optimizer state, counters,
        the epoch's metric sums, the history, random states and the data position.

        ``weights=False``: all but ``model`` and ``optimizer``, with the optimizer's hyper-parameters as
        ``optimizer_param_groups`` (a sharded backup writes the tensors apart, each rank its own shards)."""
        if weights:
            held = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        else:
            held = {"optimizer_param_groups": self.optimizer.state_dict()["param_groups"]}
        return {
            "kind": CHECKPOINT_KIND,
            **held,
            "epoch": self.epoch,
            "step": self.step,
            "step_in_epoch": self.step_in_epoch,
            "totals": self.totals.to("cpu", copy=True),
            "epoch_elapsed_s": self.epoch_elapsed_s,
            "history": [log.to_dict() for log in self.history],
            "metric_names": self.metric_set.names,
            "rng": capture_rng_state(),
            "data": self.data.state_dict() if is_resumable(self.data) else None,
            "callbacks": {key: callback.state_dict() for key, callback in self._stateful_callbacks().items()},
            # What wrote it, for `stratagem checkpoint inspect`; a resume does not need them.
            "strategy": type(self.strategy).__name__,
            "num_replicas_in_sync": int(self.strategy.num_replicas_in_sync),
            "num_processes": int(self.strategy.input_pipeline()[0]),
        }

    def _stateful_callbacks(self) -> dict[str, Any]:
        stateful = [
            c
            for c in self.callbacks
            if callable(getattr(c, "state_dict", None)) and callable(getattr(c, "load_state_dict", None))
        ]
        return {f"{i}:{type(c).__name__}": c for i, c in enumerate(stateful)}

    def load_state_dict(
        self,
        state: dict[str, Any],
        *,
        load_weights: Callable[[], None] | None = None,
        allow_new_data_seed: bool = False,
    ) -> None:
        """Restores a `state_dict` into this run (the model reaches every replica).

        `load_weights`: loads the model and optimizer in place of ``state["model"]`` and ``state["optimizer"]``
        (a sharded backup, or a whole one into a sharded model), called once the rest has been checked.
        `allow_new_data_seed`: a backup whose data seed differs from this run's resumes with the backup's seed
        (the batches of the interrupted run) instead of being refused.

        Raises:
            InputError: the state is not a fit checkpoint, or its model, optimizer or metrics
                do not match this run's.
        """
        if state.get("kind") != CHECKPOINT_KIND:
            raise InputError(
                f"This checkpoint was not written by fit. Received: kind={state.get('kind')!r:.100}. "
                "Restore it by hand, or point BackupAndRestore at a fit backup directory."
            )
        needed = _BACKUP_FIELDS if load_weights is None else _BACKUP_FIELDS[2:]
        missing = [name for name in needed if name not in state]
        if missing:
            raise InputError(
                f"The backup lacks fields that fit writes: {missing}. Received: fields {sorted(state)[:20]}. "
                "It was written by another version of stratagem or by hand: remove it to start afresh."
            )
        if list(state["metric_names"]) != self.metric_set.names:
            raise InputError(
                f"The backup tracked metrics {list(state['metric_names'])} but this run tracks "
                f"{self.metric_set.names}. Received: metrics={self.metric_set.names[1:]}. Pass the same "
                "metrics as the interrupted run, or remove the backup to start afresh."
            )
        stateful = self._stateful_callbacks()
        saved = state.get("callbacks", {})
        if sorted(saved) != sorted(stateful):
            raise InputError(
                f"The backup holds the state of callbacks {sorted(saved)} but this run has {sorted(stateful)}. "
                f"Received: callbacks={[type(c).__name__ for c in self.callbacks]}. Pass the same stateful "
                "callbacks (e.g. LearningRateScheduler) as the interrupted run, or remove the backup."
            )
        for key, callback in stateful.items():
            check = getattr(
                callback, "check_state_dict", None
            )  # optional: refuses a backup before anything is restored
            if callable(check):
                check(saved[key])
        if state["data"] is not None and is_resumable(self.data):
            saved_seed, seed = state["data"].get("seed"), self.data.state_dict().get("seed")
            if saved_seed is not None and seed is not None and saved_seed != seed and not allow_new_data_seed:
                raise InputError(
                    f"The backup's data were shuffled with seed={saved_seed!r} but this run's are shuffled with "
                    f"seed={seed!r}, so resuming would mix two orders within the epoch. Received: seed={seed!r}. "
                    f"Pass seed={saved_seed!r} as the interrupted run did, pass "
                    "BackupAndRestore(..., allow_new_data_seed=True) to resume with the backup's seed, or remove the "
                    "backup to start afresh."
                )
            self.data.load_state_dict(state["data"])  # checks the batching first: nothing else is touched yet
        try:
            if load_weights is None:
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
            else:
                load_weights()
        except (RuntimeError, ValueError, KeyError) as error:
            raise InputError(
                f"The backup does not fit this model or optimizer: {error}. Received: a backup of a "
                "different model. Build the same model and optimizer as the interrupted run, or remove "
                "the backup to start afresh."
            ) from error
        for key, callback in stateful.items():
            callback.load_state_dict(saved[key])
        try:
            self.epoch = int(state["epoch"])
            self.step = int(state["step"])
            self.step_in_epoch = int(state["step_in_epoch"])
            self.totals = state["totals"].to(torch.float64).clone()
            self.epoch_elapsed_s = float(state["epoch_elapsed_s"])
            self.history = [EpochLog.from_dict(d) for d in state["history"]]
            restore_rng_state(state["rng"])
        except (AttributeError, KeyError, TypeError, ValueError, RuntimeError) as error:
            raise InputError(
                f"The backup's counters, history or random states are malformed ({type(error).__name__}: "
                f"{str(error)[:200]}). Received: a backup fit cannot have written. Remove it to start "
                "afresh."
            ) from error


# What `TrainingContext.state_dict` writes; a backup without one of them cannot be resumed.
_BACKUP_FIELDS = (
    "model",
    "optimizer",
    "epoch",
    "step",
    "step_in_epoch",
    "totals",
    "epoch_elapsed_s",
    "history",
    "metric_names",
    "rng",
    "data",
)


def is_resumable(data: Any) -> bool:
    """Whether `data` keeps its own position (a `ShuffledBatches`): a backup saves it and a restart resumes it."""
    return all(callable(getattr(data, name, None)) for name in ("set_position", "state_dict", "load_state_dict"))
