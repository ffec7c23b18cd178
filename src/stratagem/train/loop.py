"""The step loop that `fit` and `evaluate` drive.

A step function runs once per replica on its slice of a global ``(inputs, targets)`` batch and
returns the replica's metric STATE (sums, see `stratagem.train.metrics`). `run_steps` hands the
global batches to the strategy's `run_fit_steps` (`stratagem.strategies.base.Strategy`), which
calls ``on_step`` with every step's state, summed over every replica and worker. Its default runs
the replicas in lockstep (`run_steps_synchronously`); a strategy that runs steps its own way (the
parameter server's ``ClusterCoordinator.schedule``/``join``) overrides it, and learns `fit`'s step
functions on every task through `prepare_fit_steps`.

Example:
    >>> totals = []
    >>> run_steps(strategy, step_fn, loader, totals.append)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stratagem.errors import InputError
from stratagem.strategies.base import Strategy
from stratagem.strategies.data_parallel.amp import precision_autocast
from stratagem.strategies.lockstep import OnStep, StepFn, run_in_lockstep
from stratagem.strategies.lockstep import _describe as _describe  # accumulate.py's errors describe batches alike
from stratagem.train.metrics import Metric, MetricSet, get_metrics
from stratagem.train.model_call import as_pairs, forward
from stratagem.values import flatten

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
"""``loss(outputs, targets)``, or None when the model computes the loss (see `stratagem.train.model_call`)."""


def run_steps(strategy: Strategy, step_fn: StepFn, batches: Iterable[Any], on_step: OnStep) -> None:
    """Runs `step_fn` over every global batch through the strategy's `run_fit_steps` (in lockstep by default)."""
    batches = as_pairs(batches)  # a dict or any other batch travels whole, as (batch, None)
    strategy.run_fit_steps(step_fn, batches, on_step)


run_steps_synchronously = run_in_lockstep
"""The default step loop of synchronous strategies (`stratagem.strategies.lockstep.run_in_lockstep`)."""


def make_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss: LossFn,
    metric_set: MetricSet,
    *,
    clip_grad_norm: float | None = None,
    precision: str = "32",
    scaler: Any = None,
) -> StepFn:
    """One training step on one replica: forward, mean loss, backward (combined gradients), step.

    `precision` ("32", "bf16", "fp16"): the forward pass and the loss under that autocast; `scaler` (a
    loss scaler from `strategy.distribute_scaler`, for "fp16"): the loss scaled before backward, the
    gradients unscaled before clipping, the step skipped on an inf/NaN."""

    def train_step(inputs: Any, targets: torch.Tensor | None) -> torch.Tensor:
        with precision_autocast(precision, _device_type(inputs, targets)):
            step = forward(model, loss, inputs, targets)
        loss_value = step.loss
        _check_scalar_loss(loss_value)
        # Returns with the gradients combined across replicas.
        (loss_value if scaler is None else scaler.scale(loss_value)).backward()
        if clip_grad_norm is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)
            # After backward, so the norm is that of the global gradient, as on one device.
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
        predictions = step.predictions.detach() if step.predictions is not None else None
        return metric_set.state(predictions, step.targets, loss_value.detach(), num_examples=step.num_examples)

    return train_step


def make_eval_step(model: nn.Module, loss: LossFn, metric_set: MetricSet, *, precision: str = "32") -> StepFn:
    """One evaluation step on one replica: forward and metric state, no gradients (under `precision`'s autocast)."""

    def eval_step(inputs: Any, targets: torch.Tensor | None) -> torch.Tensor:
        # no_grad inside the step: it runs on each replica's own thread, where the caller's mode does not reach.
        with torch.no_grad(), precision_autocast(precision, _device_type(inputs, targets)):
            step = forward(model, loss, inputs, targets)
            _check_scalar_loss(step.loss)
            return metric_set.state(step.predictions, step.targets, step.loss, num_examples=step.num_examples)

    return eval_step


@dataclass(frozen=True)
class Evaluation:
    """Loss and metrics of a model over a whole data set."""

    metrics: dict[str, float]
    """``{"loss": ..., "accuracy": ...}``: exact over every example, whatever the split."""
    num_examples: int

    def __getitem__(self, name: str) -> float:
        return self.metrics[name]

    @property
    def loss(self) -> float:
        return self.metrics["loss"]

    def to_dict(self) -> dict[str, Any]:
        return {**self.metrics, "num_examples": self.num_examples}


def evaluate(
    strategy: Strategy,
    model: nn.Module,
    data: Iterable[Any],
    loss: LossFn,
    *,
    metrics: Sequence[str | Metric] | None = ("accuracy",),
) -> Evaluation:
    """The mean `loss` and the `metrics` of `model` over every global ``(x, y)`` batch of `data`.

    `model` is the one `strategy.distribute` returned (or `fit`'s ``history.model``).

    Example:
        >>> sg.evaluate(strategy, history.model, test_loader, F.cross_entropy).metrics
        {'loss': 0.08, 'accuracy': 0.97}

    Raises:
        InputError: `data` yielded no example.
    """
    metric_set = MetricSet(get_metrics(metrics))
    return evaluate_with(strategy, model, make_eval_step(model, loss, metric_set), metric_set, data)


def evaluate_with(
    strategy: Strategy, model: nn.Module, eval_step: StepFn, metric_set: MetricSet, data: Iterable[Any]
) -> Evaluation:
    """`evaluate` with a step function built beforehand (`fit` builds its own once, for every task)."""
    model.train(False)
    sums: list[torch.Tensor] = [torch.zeros(metric_set.size, dtype=torch.float64)]

    def add(state: torch.Tensor, num_examples: int | None = None) -> None:
        if sums[0].device != state.device:  # summed where the states are: no read until the end
            sums[0] = sums[0].to(state.device)
        sums[0].add_(state)

    run_steps(strategy, eval_step, data, add)
    totals = sums[0].to("cpu")  # the one read of the evaluation
    count = int(totals[1])
    if count == 0:
        raise InputError(
            "The evaluation data yielded no examples, so there is nothing to measure. "
            "Received: 0 batches. Pass a loader that yields (x, y) batches."
        )
    return Evaluation(metric_set.results(totals), count)


def _check_scalar_loss(loss_value: Any) -> None:
    if not isinstance(loss_value, torch.Tensor) or loss_value.dim() != 0:
        shape = tuple(loss_value.shape) if isinstance(loss_value, torch.Tensor) else type(loss_value).__name__
        raise InputError(
            f"The loss must be a scalar tensor, the mean over the replica's examples. Received: {shape}. "
            "Use a reduction='mean' loss such as torch.nn.functional.cross_entropy."
        )


def _device_type(*values: Any) -> str:
    """The device type of the first tensor in `values` (a replica's batch), for its autocast; "cpu" without one."""
    for leaf in flatten(values):
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    return "cpu"
