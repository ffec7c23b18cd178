"""`fit`: one high-level training loop that every strategy runs unchanged.

`fit` distributes the model with the strategy it is given, feeds it GLOBAL batches, reports the
loss and the metrics of each epoch exactly (states summed over replicas and workers, then
read), evaluates on validation data, and calls callbacks (backups, progress). It uses only the
`Strategy` base class (`distribute`, `distribute_dataset`, `run`, `reduce`, and the fit steps,
input pipeline, cluster and model it declares), so every strategy runs it; a strategy that runs
steps its own way overrides ``Strategy.run_fit_steps`` (see `stratagem.train.loop`).
The state a run carries (`TrainingContext`, what backups save) and what it returns (`History`)
are in `stratagem.train.fit_state`.

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
import signal
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from stratagem.errors import InputError, Preempted
from stratagem.strategies.base import Strategy
from stratagem.strategies.data_parallel.distributed import DistributedModel, distributing_strategy
from stratagem.train.accumulate import make_accumulating_train_step, run_accumulated_steps
from stratagem.train.backup.callback import BackupAndRestore
from stratagem.train.callback import Callback
from stratagem.train.fit_checks import (
    check_backup_directories,
    check_backups_possible,
    check_callbacks,
    check_fit_arguments,
    fit_data,
)

# The run's state and records live in fit_state; they stay importable from here, where callers found them.
from stratagem.train.fit_state import CHECKPOINT_KIND as CHECKPOINT_KIND
from stratagem.train.fit_state import EpochLog as EpochLog
from stratagem.train.fit_state import History as History
from stratagem.train.fit_state import TrainingContext as TrainingContext
from stratagem.train.fit_state import is_resumable
from stratagem.train.loop import (
    LossFn,
    evaluate_with,
    make_eval_step,
    make_train_step,
    run_steps,
)
from stratagem.train.metrics import Metric, MetricSet, get_metrics
from stratagem.train.preemption import StopSignals, exit_code, fold_stop_flag, split_stop_flag
from stratagem.train.tracing import TraceOutcome, TraceSetting, check_trace, traced_run

logger = logging.getLogger(__name__)

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
    trace: TraceSetting = True,
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
        trace: True (the default): MirroredStrategy, MultiWorkerMirroredStrategy, ShardedStrategy,
            TensorParallelStrategy and ModelParallelStrategy record where each worker's steps went in summary mode
            (no spans), a sample of the steps that keeps the cost near 1% of a step, and ``history.trace`` holds
            this worker's table; the other strategies (ParameterServerStrategy, OneDeviceStrategy,
            CentralStorageStrategy) are not traced, and ``history.trace`` is None. A directory: every
            worker records every step with its spans (input, forward, backward, optimizer step, each collective
            and wait) and writes ``worker-<rank>.json`` there; the chief merges them into ``trace.json.gz`` for
            Perfetto (``stratagem trace summary DIR`` reads them); the strategy must be a
            `stratagem.trace.Traceable`. False (or None): no trace (docs/trace.md).

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
    check_trace(strategy, trace)
    metric_set = MetricSet(get_metrics(metrics))
    train_data, val_data = fit_data(strategy, data, batch_size, shuffle, seed, validation_data, validation_batch_size)
    callbacks = check_callbacks(callbacks, verbose)
    check_backup_directories(callbacks)  # a directory that cannot hold backups is refused before any work
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
    signals = _stop_signals(callbacks)
    if signals is not None:
        # The stop flag rides in the metric sums each step already makes across workers: no collective of its own.
        train_step = fold_stop_flag(train_step, signals)
    # Every task reaches this line with the same steps; a task that only runs steps (a parameter-server
    # worker) serves from here until the chief ends the job.
    strategy.prepare_fit_steps({"train": train_step, "eval": eval_step}, model)
    traced = TraceOutcome()
    try:
        with traced_run(strategy, trace, is_chief=context.is_chief, outcome=traced) as context.recorder:
            history = _train(context, callbacks, train_step, eval_step, val_data, accumulate_steps, signals)
    except BaseException:
        for callback in callbacks:
            close = getattr(callback, "close", None)
            if callable(close):
                close()
        raise
    history.trace = traced.left_on
    return history


def _train(
    context: TrainingContext,
    callbacks: list[Callback],
    train_step: Any,
    eval_step: Any,
    val_data: Any,
    accumulate_steps: int = 1,
    signals: StopSignals | None = None,
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
            stop = False
            if signals is not None:
                state, stop = split_stop_flag(state)
            if context.totals.device != state.device:  # the sums stay on the device; read at the epoch's end
                context.totals = context.totals.to(state.device)
            context.totals.add_(state)
            context.step += 1
            context.step_in_epoch += num_batches  # where the data resumes: batches, not updates
            context.epoch_elapsed_s = elapsed_before + time.perf_counter() - started
            for callback in last:
                callback.on_train_batch_end(context, int(state[1]) if num_examples is None else num_examples)
            if stop:
                raise _Stop
            if context.stop_training:
                raise _StopEpoch

        try:
            if accumulate_steps > 1:
                run_accumulated_steps(context.strategy, train_step, _epoch_batches(context), accumulate_steps, on_step)
            else:
                run_steps(context.strategy, train_step, _epoch_batches(context), on_step)
        except _StopEpoch:
            pass
        except _Stop:
            _stop_with_backup(context, backups, signals)
        log = _end_epoch(context, val_data, eval_step)
        for callback in last:
            callback.on_epoch_end(context, log)
    history = History(list(context.history), context.model, context.optimizer)
    for callback in last:
        callback.on_train_end(context, history)
    return history


class _StopEpoch(Exception):
    """A callback set stop_training: leave the step loop at once."""


class _Stop(Exception):
    """Some process received SIGTERM or SIGINT: every worker leaves the step loop after the same step."""


def _stop_signals(callbacks: Sequence[Callback]) -> StopSignals | None:
    for callback in callbacks:
        if isinstance(callback, BackupAndRestore) and callback.stop_signals is not None:
            return callback.stop_signals
    return None


def _stop_with_backup(context: TrainingContext, backups: list[BackupAndRestore], signals: StopSignals | None) -> None:
    for backup in backups:
        backup.save_on_stop(context)
    signum = (signals.requested if signals is not None else 0) or signal.SIGTERM  # a worker told by another
    if signals is not None:
        signals.acted_on()
    waited = signals.seconds_since_signal() if signals is not None else 0.0
    where = f" to {backups[0].path}" if backups and context.is_chief else ""
    message = (
        f"Stopped by {signal.Signals(signum).name} after step {context.step} (epoch {context.epoch + 1}, "
        f"{context.step_in_epoch} batch(es) into it), {waited:.2f} s after the signal; backed up{where}. Rerun the "
        "same command to resume from that step."
    )
    logger.warning(message)
    raise Preempted(message, exit_code(signum), context.step)


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
    if is_resumable(data):
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
    if isinstance(model, DistributedModel) and distributing_strategy(model) is strategy:
        return model, optimizer  # one of several models the user distributed with this strategy
    if isinstance(model, DistributedModel):
        raise InputError(
            "The model was distributed by another strategy. Received: a DistributedModel of "
            f"{type(distributing_strategy(model)).__name__}. Pass the plain model, or use that strategy."
        )
    result = strategy.distribute(model, optimizer)
    dist_model, dist_opt = result
    _DISTRIBUTED.setdefault(strategy, []).append((model, optimizer, dist_model, dist_opt))
    return dist_model, dist_opt
