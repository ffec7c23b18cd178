"""How `fit` and `evaluate` call the model and the loss on one replica's slice of a batch.

A batch is whatever the loader yields; `as_pairs` turns it into what the step functions take,
``(inputs, targets)``: an ``(inputs, targets)`` pair stays one, and any other batch (a dict, as
Hugging Face loaders yield, a longer tuple, a lone tensor, any nest) travels whole as
``(batch, None)``. Then, on each replica:

- with a loss function, a pair calls ``model(inputs)`` and ``loss(outputs, targets)``; a dict
  calls ``model(**batch_without_labels)`` and ``loss(outputs, batch["labels"])``, where
  ``outputs`` is ``outputs.logits`` when the model returns an object with logits (so
  ``F.cross_entropy`` fits a Hugging Face model as it is);
- with ``loss=None`` the model computes the loss itself: ``model(**batch)`` for a dict,
  ``model(*batch)`` for a tuple or list (a pair too), ``model(batch)`` otherwise, and the loss is
  ``outputs.loss`` (a Hugging Face ``ModelOutput``), ``outputs["loss"]``, or the output itself when
  it is a scalar tensor.

Metrics see ``outputs.logits`` (or ``outputs["logits"]``, or the output tensor) and the targets
(the pair's, or ``batch["labels"]``).

Example:
    >>> sg.fit(strategy, hf_model, optimizer, None, loader_of_dicts, epochs=3)   # loss from outputs.loss
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from stratagem.data.distributed_sampler import WorkerBatch
from stratagem.data.split import batch_size_of
from stratagem.data.worker_shards import WorkerPart
from stratagem.errors import InputError

LABELS = "labels"
"""The key of the targets in a dict batch (Hugging Face's name)."""


def as_pairs(batches: Iterable[Any]) -> Iterator[Any]:
    """Each batch as ``(inputs, targets)``: a pair as it is, any other batch as ``(batch, None)``."""
    for batch in batches:
        if isinstance(batch, WorkerPart):  # a worker's part of a global batch (data/worker_shards.py)
            yield replace(batch, batch=_as_pair(batch.batch))
        elif isinstance(batch, WorkerBatch):  # a worker's own batch (data/distributed_sampler.py)
            yield WorkerBatch(_as_pair(batch.batch))
        else:
            yield _as_pair(batch)


def _as_pair(batch: Any) -> Any:
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and not hasattr(batch, "_fields"):
        return batch
    return (batch, None)


@dataclass(frozen=True)
class Forward:
    """What one replica's forward pass gave: the mean loss, and what metrics are computed from."""

    loss: torch.Tensor
    predictions: torch.Tensor | None
    """The output scores metrics read (``outputs.logits`` or the output tensor), if any."""
    targets: torch.Tensor | None
    num_examples: int


def forward(model: nn.Module, loss: Callable[..., torch.Tensor] | None, inputs: Any, targets: Any) -> Forward:
    """Calls `model` (and `loss`) on one replica's `inputs` and `targets` (None: `inputs` is the whole batch)."""
    whole = targets is None
    labels = targets
    if whole and isinstance(inputs, Mapping):
        labels = inputs.get(LABELS)
    if loss is not None:
        if whole and isinstance(inputs, Mapping):
            if labels is None:
                raise InputError(
                    f"With a loss function, a dict batch needs its targets under {LABELS!r}. Received: keys "
                    f"{sorted(map(str, inputs))}. Add a {LABELS!r} entry, or pass loss=None to use the model's own "
                    "loss (outputs.loss)."
                )
            outputs = model(**{k: v for k, v in inputs.items() if k != LABELS})
        elif whole:
            raise InputError(
                "With a loss function, each batch must be an (inputs, targets) pair or a dict with 'labels'. "
                f"Received: {_describe(inputs)}. Yield (x, y) pairs, or pass loss=None when the model returns its "
                "own loss."
            )
        else:
            outputs = model(inputs)
        loss_value = loss(_predictions(outputs, required=True), labels)
    else:
        batch = inputs if whole else (inputs, targets)
        if isinstance(batch, Mapping):
            outputs = model(**batch)
        elif isinstance(batch, (tuple, list)):
            outputs = model(*batch)
        else:
            outputs = model(batch)
        loss_value = _own_loss(outputs)
    if isinstance(labels, torch.Tensor) and labels.dim() > 0:
        num = int(labels.shape[0])
    else:
        num = batch_size_of(inputs)
    return Forward(
        loss_value, _predictions(outputs, required=False), labels if isinstance(labels, torch.Tensor) else None, num
    )


def _own_loss(outputs: Any) -> torch.Tensor:
    value = getattr(outputs, "loss", None)
    if value is None and isinstance(outputs, Mapping):
        value = outputs.get("loss")
    if value is None and isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
        value = outputs
    if value is None:
        raise InputError(
            "With loss=None the model must compute the loss: return an object with .loss (a Hugging Face ModelOutput "
            f"when the batch holds labels), a dict with 'loss', or the scalar loss. Received: {_describe(outputs)}. "
            "Put the labels in the batch, or pass a loss function."
        )
    return value


def _predictions(outputs: Any, required: bool) -> Any:
    for value in (getattr(outputs, "logits", None), outputs.get("logits") if isinstance(outputs, Mapping) else None):
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(outputs, torch.Tensor):
        return outputs if (required or outputs.dim() > 0) else None
    return outputs if required else None


def _describe(value: Any) -> str:
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {sorted(map(str, value))}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} element(s)"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__
