"""`fit`'s arguments, checked before any work starts, and the batches its data arguments name.

Every check raises `InputError` with the value received and the fix; `fit` calls them in the order
a user reads its signature, so the first wrong argument is the one reported.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from stratagem.data.resume import ShuffledBatches
from stratagem.errors import InputError
from stratagem.strategies.base import Strategy
from stratagem.strategies.data_parallel.amp import check_precision
from stratagem.train.backup.callback import BackupAndRestore
from stratagem.train.callback import Callback
from stratagem.train.progress_bar import ProgressBar

logger = logging.getLogger(__name__)


def check_fit_arguments(
    strategy: Strategy,
    optimizer: Any,
    loss: Any,
    epochs: Any,
    steps_per_epoch: Any,
    clip_grad_norm: Any,
    accumulate_steps: Any,
    precision: str,
) -> str:
    """Refuses a bad argument of `fit`; returns the precision as `fit` runs it."""
    _check_arguments(strategy, optimizer, loss, epochs, steps_per_epoch, clip_grad_norm)
    _check_accumulate_steps(strategy, accumulate_steps)
    precision = check_precision(precision, [d.type for d in strategy.local_devices])
    if precision == "fp16" and accumulate_steps > 1:
        raise InputError(
            "precision='fp16' and accumulate_steps > 1 cannot be combined yet: the loss scaler would have to skip a "
            f"whole group of micro-batches. Received: precision='fp16', accumulate_steps={accumulate_steps}. Use "
            "precision='bf16' (no loss scaling needed) or accumulate_steps=1."
        )
    return precision


def fit_data(
    strategy: Strategy,
    data: Any,
    batch_size: int | None,
    shuffle: bool,
    seed: int,
    validation_data: Any,
    validation_batch_size: int | None,
) -> tuple[Any, Any]:
    """The training and validation batches (the latter None), this process's part of them under several workers."""
    train_data = _as_batches(data, batch_size, shuffle, seed, "data")
    if validation_batch_size is None and not _is_batched(validation_data):
        validation_batch_size = batch_size  # a validation data set is batched as the training one
    val_data = (
        None
        if validation_data is None
        else _as_batches(validation_data, validation_batch_size, False, seed, "validation_data")
    )
    train_data = _worker_part(strategy, train_data, note=True)
    val_data = None if val_data is None else _worker_part(strategy, val_data, note=False)
    return train_data, val_data


def check_callbacks(callbacks: Sequence[Callback] | None, verbose: bool) -> list[Callback]:
    """The run's callbacks, with a `ProgressBar` added for `verbose`."""
    checked = list(callbacks or [])
    for callback in checked:
        if not isinstance(callback, Callback):
            raise InputError(
                f"Every callback must be a stratagem.train.Callback. Received: {type(callback).__name__}. "
                "Subclass Callback and override the hooks you need."
            )
    if verbose and not any(isinstance(c, ProgressBar) for c in checked):
        checked.append(ProgressBar())
    return checked


def check_backup_directories(callbacks: Sequence[Callback]) -> None:
    """Every `BackupAndRestore`'s directory can be made and written, checked before the model is distributed."""
    for callback in callbacks:
        if isinstance(callback, BackupAndRestore):
            callback.check_directory()


def check_backups_possible(callbacks: Sequence[Callback], optimizer: Any) -> None:
    """A `BackupAndRestore` needs an optimizer whose state it can save (not the parameter server's)."""
    if any(isinstance(c, BackupAndRestore) for c in callbacks) and not callable(getattr(optimizer, "state_dict", None)):
        raise InputError(
            f"BackupAndRestore cannot back up this optimizer: {type(optimizer).__name__} has no state_dict (under "
            "ParameterServerStrategy the optimizer state lives on the parameter servers). Received: callbacks="
            f"{[type(c).__name__ for c in callbacks]}. Leave BackupAndRestore out; under the parameter server save "
            "with strategy.save(path) and strategy.restore(path)."
        )


def _is_batched(data: Any) -> bool:
    """A DataLoader, a generator, a ShuffledBatches: an iterable that yields batches already."""
    return (hasattr(data, "__iter__") and not hasattr(data, "__getitem__")) or isinstance(data, ShuffledBatches)


def _as_batches(data: Any, batch_size: int | None, shuffle: bool, seed: int, name: str) -> Any:
    if batch_size is not None:
        if _is_batched(data):
            # A DataLoader, a generator, a ShuffledBatches: already batched.
            raise InputError(
                f"{name} is already an iterable of batches, so a batch size cannot apply to it. Received: "
                f"{type(data).__name__} with a batch size of {batch_size}. Drop the batch size, or pass the data set "
                "itself (for a DataLoader: loader.dataset)."
            )
        return ShuffledBatches(data, batch_size, shuffle=shuffle, seed=seed)
    if isinstance(data, (torch.Tensor, str, bytes, dict)) or not isinstance(data, Iterable):
        raise InputError(
            f"{name} must be an iterable of GLOBAL (inputs, targets) batches, or a data set with a batch size. "
            f"Received: {type(data).__name__}. Pass e.g. a DataLoader, or (x, y) with batch_size=64."
        )
    if isinstance(data, tuple) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        raise InputError(
            f"{name} is a pair of tensors: give a batch size to batch it. Received: tensors of shapes "
            f"{[tuple(t.shape) for t in data]} and no batch size. Add batch_size=64 (or validation_batch_size)."
        )
    # Not iter(data) is data: that starts a DataLoader's iteration (its worker processes too) and draws from
    # its generator, so the first epoch's shuffle would differ from the loader's own first order.
    if isinstance(data, Iterator):
        logger.info("%s is an iterator: it can be read only once, so it serves one epoch.", name)
    return data


def _worker_part(strategy: Strategy, data: Any, *, note: bool) -> Any:
    """Under several worker processes, the data each worker reads only its part of (when it can be cut by index).

    Done here, before the data is wrapped for an epoch: what reaches `distribute_dataset` is then a generator.
    """
    return strategy.shard_input(data, note=note)


def _check_accumulate_steps(strategy: Strategy, accumulate_steps: Any) -> None:
    if isinstance(accumulate_steps, bool) or not isinstance(accumulate_steps, int) or accumulate_steps < 1:
        raise InputError(
            f"accumulate_steps must be a positive whole number of batches per update. "
            f"Received: accumulate_steps={accumulate_steps!r}. Use e.g. accumulate_steps=4."
        )
    if accumulate_steps > 1 and not strategy.is_synchronous:
        raise InputError(
            f"accumulate_steps needs a synchronous strategy, where every replica takes part in each "
            f"update; {type(strategy).__name__} runs each step on one worker, on its own schedule. "
            f"Received: accumulate_steps={accumulate_steps}. Use a larger batch_size instead, or a "
            "synchronous strategy (MirroredStrategy, MultiWorkerMirroredStrategy)."
        )


def _check_arguments(
    strategy: Strategy, optimizer: Any, loss: Any, epochs: Any, steps_per_epoch: Any, clip_grad_norm: Any
) -> None:
    if not isinstance(strategy, Strategy):
        raise InputError(
            f"fit needs a stratagem strategy first. Received: {type(strategy).__name__}. "
            "Use e.g. sg.MirroredStrategy() or sg.OneDeviceStrategy('cpu:0')."
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputError(
            f"fit needs a torch.optim.Optimizer. Received: {type(optimizer).__name__}. "
            "Build one from model.parameters(), e.g. torch.optim.Adam(model.parameters())."
        )
    if loss is not None and not callable(loss):
        raise InputError(
            f"loss must be a function of (outputs, targets). Received: {type(loss).__name__}. "
            "Use e.g. torch.nn.functional.cross_entropy, or loss=None when the model computes the "
            "loss itself (outputs.loss)."
        )
    for name, value in (("epochs", epochs), ("steps_per_epoch", steps_per_epoch)):
        if value is None and name == "steps_per_epoch":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive integer. Received: {name}={value!r}.")
    if clip_grad_norm is not None and not (isinstance(clip_grad_norm, (int, float)) and clip_grad_norm > 0):
        raise InputError(
            f"clip_grad_norm must be a positive number or None. Received: clip_grad_norm={clip_grad_norm!r}."
        )
