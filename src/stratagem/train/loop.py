"""One training epoch and one evaluation pass of a classifier, through any strategy.

Metrics are exact over the global batch whatever the split among replicas: each replica returns
sums (loss times examples, correct predictions, examples) and the strategy adds them up, so an
accuracy is never an average of per-replica accuracies (which would be wrong for uneven splits).

Example:
    >>> strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> model, optimizer = strategy.distribute(net, torch.optim.Adam(net.parameters()))
    >>> epoch = train_epoch(strategy, model, optimizer, train_loader, epoch=1)
    >>> epoch.loss, epoch.accuracy
    >>> evaluate(strategy, model, test_loader).accuracy
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stratagem.errors import InputError
from stratagem.strategies.base import Strategy

StepCallback = Callable[[int, int], None]
"""Called after each training step with (examples in this step, examples so far in the epoch)."""


@dataclass(frozen=True)
class EpochResult:
    """What one training epoch measured, over every example it saw."""

    epoch: int
    """1-based epoch number."""
    loss: float
    """Mean cross-entropy over the epoch's examples, as computed during training (before each update)."""
    accuracy: float
    """Correct predictions / examples, counted during training."""
    num_examples: int
    elapsed_s: float
    """Wall time of the epoch's training steps."""

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "loss": self.loss, "accuracy": self.accuracy,
                "num_examples": self.num_examples, "elapsed_s": self.elapsed_s}


@dataclass(frozen=True)
class EvalResult:
    """Loss and accuracy of a model over a whole data set."""

    loss: float
    accuracy: float
    num_examples: int

    def to_dict(self) -> dict[str, Any]:
        return {"loss": self.loss, "accuracy": self.accuracy, "num_examples": self.num_examples}


def train_epoch(strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Iterable[Any], *,
                epoch: int, on_step: StepCallback | None = None) -> EpochResult:
    """Trains ``model`` for one pass over ``loader`` (GLOBAL ``(x, y)`` batches) with cross-entropy.

    ``model`` and ``optimizer`` are the pair ``strategy.distribute`` returned.

    Raises:
        InputError: the loader yielded no batch.
    """
    model.train()

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()  # returns with the gradients combined across replicas
        optimizer.step()
        optimizer.zero_grad()
        return _sums(logits.detach(), y, loss.detach())

    start = time.perf_counter()
    totals = _Totals()
    for x, y in strategy.distribute_dataset(loader):
        num = totals.add(strategy, strategy.run(step, args=(x, y)))
        if on_step is not None:
            on_step(num, totals.count)
    elapsed = time.perf_counter() - start
    loss, accuracy = totals.result("the training loader")
    return EpochResult(epoch=epoch, loss=loss, accuracy=accuracy, num_examples=totals.count, elapsed_s=elapsed)


def evaluate(strategy: Strategy, model: nn.Module, loader: Iterable[Any]) -> EvalResult:
    """Cross-entropy and accuracy of ``model`` over every ``(x, y)`` batch of ``loader``, without training.

    Raises:
        InputError: the loader yielded no batch.
    """
    model.eval()

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # no_grad inside the step: it runs on each replica's own thread, where the caller's mode does not reach.
        with torch.no_grad():
            logits = model(x)
            return _sums(logits, y, F.cross_entropy(logits, y))

    totals = _Totals()
    for x, y in strategy.distribute_dataset(loader):
        totals.add(strategy, strategy.run(step, args=(x, y)))
    loss, accuracy = totals.result("the evaluation loader")
    return EvalResult(loss=loss, accuracy=accuracy, num_examples=totals.count)


def _sums(logits: torch.Tensor, y: torch.Tensor, mean_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss summed over this replica's examples, correct predictions, examples), all float64."""
    num = torch.tensor(float(y.shape[0]), dtype=torch.float64, device=y.device)
    if y.shape[0] == 0:
        # An empty slice (fewer examples than replicas): its mean loss is NaN, its sums are zero.
        zero = torch.zeros((), dtype=torch.float64, device=y.device)
        return zero, zero, num
    correct = (logits.argmax(dim=1) == y).sum().to(torch.float64)
    return mean_loss.to(torch.float64) * num, correct, num


class _Totals:
    """Running sums of loss, correct predictions and examples, reduced across replicas."""

    def __init__(self) -> None:
        self.loss_sum = 0.0
        self.correct = 0
        self.count = 0

    def add(self, strategy: Strategy, per_replica: Any) -> int:
        loss_sum, correct, num = strategy.reduce("sum", per_replica)
        num_examples = int(num.item())
        self.loss_sum += float(loss_sum.item())
        self.correct += int(correct.item())
        self.count += num_examples
        return num_examples

    def result(self, what: str) -> tuple[float, float]:
        if self.count == 0:
            raise InputError(f"{what} yielded no examples, so there is nothing to measure. Received: 0 batches.")
        return self.loss_sum / self.count, self.correct / self.count
