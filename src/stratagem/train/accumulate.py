"""`fit(..., accumulate_steps=K)`: one optimizer update per K consecutive global batches.

Each group of K batches (fewer at the end of an epoch) gives the update of ONE batch holding all of
the group's examples: every micro-batch's mean loss is scaled by its share of the group's examples
before its backward pass, so the accumulated gradient is the gradient of the mean loss over the
group, whatever the micro-batch sizes. The first K-1 backward passes run inside
`strategy.no_sync()` (replicas accumulate their own gradients; see
`stratagem.strategies.data_parallel.accumulation`), the last combines them and steps the optimizer.

For `fit` and its callbacks a group is one step: `on_step` is called once per group with the
metric states of its micro-batches summed (on the device the strategy reduced them to, read by `fit`
once an epoch) and the group's global example count, so ``save_freq`` and schedulers count updates, and
a backup always falls between two updates (no accumulated gradient is lost by a restart).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from stratagem.data.split import batch_size_of
from stratagem.errors import InputError
from stratagem.strategies.base import Strategy
from stratagem.strategies.data_parallel.amp import precision_autocast
from stratagem.train.loop import LossFn, _check_scalar_loss, _describe, _device_type
from stratagem.train.metrics import MetricSet
from stratagem.train.model_call import as_pairs, forward
from stratagem.values import PerReplica, flatten

MicroStepFn = Callable[[Any, Any, float, bool], torch.Tensor]
"""``step_fn(inputs, targets, scale, last)`` on one replica -> that replica's metric state vector."""


def make_accumulating_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss: LossFn,
    metric_set: MetricSet,
    *,
    clip_grad_norm: float | None = None,
    precision: str = "32",
) -> MicroStepFn:
    """One micro-batch on one replica: forward, backward of the scaled mean loss; the last of a group steps.
    `precision` ("32" or "bf16"): the forward pass and the loss under that autocast.

    Raises:
        InputError: ``loss`` is None (the model's own loss): the micro-steps call ``loss(outputs, targets)``.
    """
    if loss is None:
        raise InputError(
            "Gradient accumulation needs a loss function. Received: loss=None with accumulate_steps > 1. "
            "Pass loss=loss_fn (called as loss_fn(outputs, targets)), or accumulate_steps=1 to train "
            "on the model's own loss."
        )
    loss_fn = loss  # narrowed for the closure below

    def train_step(inputs: Any, targets: torch.Tensor | None, scale: float, last: bool) -> torch.Tensor:
        # The model and the loss called as fit's own step calls them: a Hugging Face output's logits to the loss, a
        # dict batch's "labels" as the targets.
        with precision_autocast(precision, _device_type(inputs, targets)):
            step = forward(model, loss_fn, inputs, targets)
        loss_value = step.loss
        _check_scalar_loss(loss_value)
        (loss_value * scale).backward()
        if last:
            if clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)  # the group's combined gradient
            optimizer.step()
            optimizer.zero_grad()
        predictions = step.predictions.detach() if step.predictions is not None else None
        return metric_set.state(predictions, step.targets, loss_value.detach())

    return train_step


def run_accumulated_steps(
    strategy: Strategy,
    step_fn: MicroStepFn,
    batches: Iterable[Any],
    accumulate_steps: int,
    on_step: Callable[..., None],
) -> None:
    """Runs `step_fn` over every global batch, K at a time; ``on_step(state, num_examples, num_batches=n)`` once
    per group, `state` left on the device the strategy reduced it to.

    Raises:
        InputError: a batch is not an ``(inputs, targets)`` pair.
    """
    group: list[Any] = []
    for batch in as_pairs(batches):  # a dict or any other batch travels whole, as (batch, None), as in run_steps
        group.append(batch)
        if len(group) == accumulate_steps:
            _run_group(strategy, step_fn, group, on_step)
            group = []
    if group:
        _run_group(strategy, step_fn, group, on_step)


def _run_group(strategy: Strategy, step_fn: MicroStepFn, group: list[Any], on_step: Callable[..., None]) -> None:
    # Every micro-batch is distributed before the first runs: its scale needs the group's global count,
    # which under several workers only the distributed batches know.
    distributed = list(strategy.distribute_dataset(group))
    for index, batch in enumerate(distributed):
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise InputError(
                f"Batch {index} of an accumulation group is not an (inputs, targets) pair. Received: {_describe(batch)}. "
                "Make the loader yield (x, y) tuples, e.g. DataLoader(TensorDataset(x, y), batch_size=64)."
            )
    counts = [_global_examples(batch) for batch in distributed]
    total = sum(counts)
    summed: torch.Tensor | None = None
    for index, (batch, count) in enumerate(zip(distributed, counts)):
        last = index == len(distributed) - 1
        with contextlib.nullcontext() if last else strategy.no_sync():
            per_replica = strategy.run(step_fn, args=(*batch, count / total, last))
        # Summed where the strategy reduced it: a copy to the CPU here would make the CPU wait for the GPU
        # at every micro-batch. fit reads the sums once an epoch; the group's example count is known here.
        state = strategy.reduce("sum", per_replica).detach().to(dtype=torch.float64)
        summed = state if summed is None else summed + state
    if summed is not None:
        on_step(summed, total, num_batches=len(distributed))


def _global_examples(batch: Any) -> int:
    """Examples in a distributed global batch, across every replica and worker."""
    for leaf in flatten(batch):
        if isinstance(leaf, PerReplica) and leaf.batch_sizes is not None:
            return leaf.global_size if leaf.global_size is not None else sum(leaf.batch_sizes)
    return batch_size_of(batch)
