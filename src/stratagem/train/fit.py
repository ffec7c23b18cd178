"""`fit`: one high-level training loop that every strategy runs unchanged.

`fit` distributes the model with the strategy it is given, feeds it GLOBAL batches, reports the
loss and the metrics of each epoch exactly (states summed over replicas and workers, then
read), evaluates on validation data, and calls callbacks (backups, progress). It uses only the
`Strategy` base class (`distribute`, `distribute_dataset`, `run`, `reduce`, and the fit steps,
input pipeline, cluster and model it declares), so every strategy runs it; a strategy that runs
steps its own way overrides ``Strategy.run_fit_steps`` (see `stratagem.train.loop`).

Example:
    >>> strategy = sg.MirroredStrategy()
    >>> net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    >>> history = sg.fit(strategy, net, torch.optim.Adam(net.parameters()), F.cross_entropy,
    ...                  (x, y), batch_size=256, epochs=5, metrics=["accuracy"], validation_data=(vx, vy))
    >>> history.history["val_accuracy"]
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stratagem.errors import InputError
from stratagem.strategies.base import Strategy
from stratagem.strategies.distributed import DistributedModel, distributing_strategy
from stratagem.train.accumulate import make_accumulating_train_step, run_accumulated_steps
from stratagem.train.callbacks import BackupAndRestore, Callback
from stratagem.train.checkpoint import capture_rng_state, restore_rng_state
from stratagem.train.fit_checks import check_backups_possible, check_callbacks, check_fit_arguments, fit_data
from stratagem.train.loop import (
    LossFn,
    evaluate_with,
    make_eval_step,
    make_train_step,
    run_steps,
)
from stratagem.train.metrics import Metric, MetricSet, get_metrics

logger = logging.getLogger(__name__)

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
    callbacks: list[Callback] = field(default_factory=list)
    """The run's callbacks; those with ``state_dict``/``load_state_dict`` travel in backups."""

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

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: parameters, buffers, optimizer state, counters,
        the epoch's metric sums, the history, random states and the data position."""
        return {
            "kind": CHECKPOINT_KIND,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "epoch": self.epoch,
            "step": self.step,
            "step_in_epoch": self.step_in_epoch,
            "totals": self.totals.to("cpu", copy=True),
            "epoch_elapsed_s": self.epoch_elapsed_s,
            "history": [log.to_dict() for log in self.history],
            "metric_names": self.metric_set.names,
            "rng": capture_rng_state(),
            "data": self.data.state_dict() if _is_resumable(self.data) else None,
            "callbacks": {key: callback.state_dict() for key, callback in self._stateful_callbacks().items()},
        }

    def _stateful_callbacks(self) -> dict[str, Any]:
        stateful = [
            c
            for c in self.callbacks
            if callable(getattr(c, "state_dict", None)) and callable(getattr(c, "load_state_dict", None))
        ]
        return {f"{i}:{type(c).__name__}": c for i, c in enumerate(stateful)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a `state_dict` into this run (the model reaches every replica).

        Raises:
            InputError: the state is not a fit checkpoint, or its model, optimizer or metrics
                do not match this run's.
        """
        if state.get("kind") != CHECKPOINT_KIND:
            raise InputError(
                f"This checkpoint was not written by fit. Received: kind={state.get('kind')!r:.100}. "
                "Restore it by hand, or point BackupAndRestore at a fit backup directory."
            )
        missing = [name for name in _BACKUP_FIELDS if name not in state]
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
        if state["data"] is not None and _is_resumable(self.data):
            self.data.load_state_dict(state["data"])  # checks the batching first: nothing else is touched yet
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
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

# The pair `distribute` returned for each (strategy, model) fit has seen, so that calling fit again
# with the same model continues training it instead of distributing it a second time.
_DISTRIBUTED: weakref.WeakKeyDictionary[Strategy, list[tuple[Any, ...]]] = weakref.WeakKeyDictionary()


def fit(
    strategy: Strategy,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss: LossFn,
    data: Any,
    *,
    epochs: int = 1,
    batch_size: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    steps_per_epoch: int | None = None,
    validation_data: Any = None,
    validation_batch_size: int | None = None,
    metrics: Sequence[str | Metric] | None = None,
    callbacks: Sequence[Callback] | None = None,
    clip_grad_norm: float | None = None,
    accumulate_steps: int = 1,
    precision: str = "32",
    verbose: bool = False,
) -> History:
    """Trains `model` with `optimizer` on `data` under `strategy` and returns the history per epoch.

    Args:
        strategy: any stratagem strategy.
        model, optimizer: the plain model and its optimizer (fit distributes them), or the pair
            `strategy.distribute` (or an earlier fit, ``history.model``) returned.
        loss: ``loss(outputs, targets)``, the MEAN over the examples it is given (as
            ``F.cross_entropy``), so replicas' losses combine into the global batch's mean; or None
            when the model computes the loss itself (``outputs.loss``, as Hugging Face models do).
        data: an iterable of GLOBAL batches (a DataLoader, ``num_workers > 0`` and iterable data sets
            included, a list, a `sg.data.ShuffledBatches`): ``(inputs, targets)`` pairs, dicts (the
            targets under ``"labels"``) or any nest of tensors (see `stratagem.train.model_call`);
            or with `batch_size` a data set: a tuple ``(x, y)`` of tensors or a map-style data set,
            batched by a `ShuffledBatches(seed=seed, shuffle=shuffle)`.
        epochs: passes over `data`.
        steps_per_epoch: stop each epoch after this many batches (needed for endless iterables).
        validation_data, validation_batch_size: evaluated after each epoch (``val_`` metrics); a
            validation data set is batched by `validation_batch_size`, by default `batch_size`.
        metrics: names from `stratagem.train.metrics.METRICS` (``"accuracy"``...) or `Metric` objects.
        callbacks: `Callback` objects, e.g. ``BackupAndRestore`` (it restores before the others
            start and backs up after the others ran for the step or epoch), ``LearningRateScheduler``.
        clip_grad_norm: clip the (combined, global) gradient to this norm before each update.
        accumulate_steps: one update per this many consecutive batches: the update of one batch
            holding all their examples (each micro-batch's loss weighted by its share of them), the
            replicas combining gradients once per update (`strategy.no_sync()`). For callbacks and
            ``save_freq`` a step is an update; ``steps_per_epoch`` still counts batches.
        precision: "32" (float32, the default), "bf16" (forward and loss under bfloat16 autocast, on CPUs
            and GPUs) or "fp16" (float16 autocast with loss scaling, one scale for every replica and
            worker; GPUs only).
        verbose: show a progress bar and one line per epoch on the chief (adds a `ProgressBar`).

    Example:
        >>> history = sg.fit(sg.MirroredStrategy(), net, torch.optim.SGD(net.parameters(), lr=0.1),
        ...                  F.cross_entropy, loader, epochs=3, metrics=["accuracy"])
        >>> history.history["accuracy"]

    Raises:
        InputError: a bad argument (checked before any work starts), or a backup that does not
            match this run.
    """
    precision = check_fit_arguments(
        strategy, optimizer, loss, epochs, steps_per_epoch, clip_grad_norm, accumulate_steps, precision
    )
    metric_set = MetricSet(get_metrics(metrics))
    train_data, val_data = fit_data(strategy, data, batch_size, shuffle, seed, validation_data, validation_batch_size)
    callbacks = check_callbacks(callbacks, verbose)
    model, optimizer = _ensure_distributed(strategy, model, optimizer)
    check_backups_possible(callbacks, optimizer)  # found now rather than at the first backup, an epoch in
    context = TrainingContext(
        strategy=strategy,
        model=model,
        optimizer=optimizer,
        data=train_data,
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        is_chief=is_chief(strategy),
        metric_set=metric_set,
        totals=torch.zeros(metric_set.size, dtype=torch.float64),
        callbacks=callbacks,
    )
    scaler = strategy.distribute_scaler(torch.amp.GradScaler("cuda")) if precision == "fp16" else None
    train_step: Any  # a micro-step (inputs, targets, scale, last) or a whole step (inputs, targets)
    if accumulate_steps > 1:
        train_step = make_accumulating_train_step(
            model, optimizer, loss, metric_set, clip_grad_norm=clip_grad_norm, precision=precision
        )
    else:
        train_step = make_train_step(
            model, optimizer, loss, metric_set, clip_grad_norm=clip_grad_norm, precision=precision, scaler=scaler
        )
    eval_step = make_eval_step(model, loss, metric_set, precision=precision)
    # Every task reaches this line with the same steps; a task that only runs steps (a parameter-server
    # worker) serves from here until the chief ends the job.
    strategy.prepare_fit_steps({"train": train_step, "eval": eval_step}, model)
    try:
        history = _train(context, callbacks, train_step, eval_step, val_data, accumulate_steps)
    except BaseException:
        for callback in callbacks:
            close = getattr(callback, "close", None)
            if callable(close):
                close()
        raise
    return history


def _train(
    context: TrainingContext,
    callbacks: list[Callback],
    train_step: Any,
    eval_step: Any,
    val_data: Any,
    accumulate_steps: int = 1,
) -> History:
    # Backups restore before any other callback starts and save after every other callback has
    # run for the step or epoch (a scheduler's step included), so a backup holds the state that follows.
    backups = [c for c in callbacks if isinstance(c, BackupAndRestore)]
    others = [c for c in callbacks if not isinstance(c, BackupAndRestore)]
    first, last = backups + others, others + backups
    for callback in first:
        callback.on_train_begin(context)
    _check_workers_agree(context)
    while context.epoch < context.epochs and not context.stop_training:
        context.model.train(True)
        for callback in first:
            callback.on_epoch_begin(context)
        started = time.perf_counter()
        elapsed_before = context.epoch_elapsed_s

        def on_step(
            state: torch.Tensor,
            num_examples: int | None = None,
            started: float = started,
            elapsed_before: float = elapsed_before,
            *,
            num_batches: int = 1,
        ) -> None:
            if context.totals.device != state.device:  # the sums stay on the device; read at the epoch's end
                context.totals = context.totals.to(state.device)
            context.totals.add_(state)
            context.step += 1
            context.step_in_epoch += num_batches  # where the data resumes: batches, not updates
            context.epoch_elapsed_s = elapsed_before + time.perf_counter() - started
            for callback in last:
                callback.on_train_batch_end(context, int(state[1]) if num_examples is None else num_examples)
            if context.stop_training:
                raise _StopEpoch

        try:
            if accumulate_steps > 1:
                run_accumulated_steps(context.strategy, train_step, _epoch_batches(context), accumulate_steps, on_step)
            else:
                run_steps(context.strategy, train_step, _epoch_batches(context), on_step)
        except _StopEpoch:
            pass
        log = _end_epoch(context, val_data, eval_step)
        for callback in last:
            callback.on_epoch_end(context, log)
    history = History(list(context.history), context.model, context.optimizer)
    for callback in last:
        callback.on_train_end(context, history)
    return history


class _StopEpoch(Exception):
    """A callback set stop_training: leave the step loop at once."""


def _end_epoch(context: TrainingContext, val_data: Any, eval_step: Any) -> EpochLog:
    totals = context.totals.to("cpu")  # the epoch's one read of the sums kept on the device
    count = int(totals[1])
    if count == 0:
        raise InputError(
            f"Epoch {context.epoch + 1} had no training example. Received: data that yielded no batch "
            f"(steps_per_epoch={context.steps_per_epoch}). Check that the loader is not exhausted "
            "(a generator can be iterated only once: pass a list or a DataLoader)."
        )
    metrics = context.metric_set.results(totals)
    if val_data is not None:
        evaluation = evaluate_with(context.strategy, context.model, eval_step, context.metric_set, val_data)
        metrics.update({f"val_{name}": value for name, value in evaluation.metrics.items()})
    log = EpochLog(context.epoch + 1, metrics, count, context.epoch_elapsed_s)
    context.history.append(log)
    context.epoch += 1
    context.step_in_epoch = 0
    context.totals = torch.zeros_like(context.totals)
    context.epoch_elapsed_s = 0.0
    return log


def _epoch_batches(context: TrainingContext) -> Iterable[Any]:
    """The global batches of the current epoch, from the batch where it stands (after a restore)."""
    data, epoch, offset = context.data, context.epoch, context.step_in_epoch
    limit = None if context.steps_per_epoch is None else max(0, context.steps_per_epoch - offset)
    if _is_resumable(data):
        data.set_position(epoch, offset)
        return data if limit is None else itertools.islice(data, limit)
    set_epoch = getattr(data, "set_epoch", None) or getattr(getattr(data, "sampler", None), "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)  # the DistributedSampler convention: a new order each epoch, fixed by the epoch
    if offset:
        # A source without a position: re-read and drop the batches already trained on (exact when
        # the order of an epoch is fixed, e.g. by set_epoch).
        logger.info("Skipping %d batch(es) of epoch %d already trained on before the restart.", offset, epoch + 1)
    end = None if limit is None else offset + limit
    return itertools.islice(data, offset, end) if (offset or end is not None) else data


def is_chief(strategy: Strategy) -> bool:
    """Whether this process is the chief of `strategy`'s cluster (True for single-process strategies)."""
    cluster = strategy.cluster
    return cluster is None or bool(cluster.is_chief)


def _check_workers_agree(context: TrainingContext) -> None:
    """Every process running this fit must start at the same step (they restored the same backup, or none)."""
    # One input pipeline per process that runs the training loop (MultiWorkerMirrored: every worker).
    num_processes, process_id = context.strategy.input_pipeline()
    if num_processes <= 1:
        return
    mine = torch.tensor([float(context.step), float(context.step) ** 2], dtype=torch.float64)
    # reduce("sum") of a value that is not per-replica counts it once per replica, in every process.
    sums = context.strategy.reduce("sum", mine).to("cpu") / context.strategy.num_replicas_in_sync
    mean, mean_square = float(sums[0]), float(sums[1])
    if abs(mean - context.step) > 1e-6 or abs(mean_square - mean * mean) > 1e-6:
        cluster = context.strategy.cluster
        who = cluster.task_name if cluster is not None else f"process {process_id}"
        raise InputError(
            f"The workers start from different steps: {who} is at step {context.step}, the mean over the "
            f"{num_processes} workers is {mean:g}. Received: backups that differ between workers. Give every worker "
            "the same backup_dir on a shared file system, or remove the backups to start afresh."
        )


def _ensure_distributed(strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
    for raw_model, raw_opt, dist_model, dist_opt in _DISTRIBUTED.get(strategy, []):
        if model is raw_model or model is dist_model:
            if optimizer is not raw_opt and optimizer is not dist_opt:
                raise InputError(
                    "This model was distributed with another optimizer by an earlier fit. Received: an optimizer that "
                    "is not the one fit distributed with it. Pass history.optimizer of the earlier fit."
                )
            return dist_model, dist_opt
    if model is strategy.distributed_model:
        return model, optimizer  # the user already called strategy.distribute
    if isinstance(model, DistributedModel):
        raise InputError(
            "The model was distributed by another strategy. Received: a DistributedModel of "
            f"{type(distributing_strategy(model)).__name__}. Pass the plain model, or use that strategy."
        )
    result = strategy.distribute(model, optimizer)
    dist_model, dist_opt = result
    _DISTRIBUTED.setdefault(strategy, []).append((model, optimizer, dist_model, dist_opt))
    return dist_model, dist_opt


def _is_resumable(data: Any) -> bool:
    return all(callable(getattr(data, name, None)) for name in ("set_position", "state_dict", "load_state_dict"))
