"""Metrics whose state is a vector of sums, combined across replicas and workers before it is read.

Each replica computes its metrics' STATE over its slice of the global batch (for accuracy:
correct predictions and examples); the strategy sums the states over replicas and workers and
only then is the result read (correct / examples). So an accuracy over an uneven split is the
true global accuracy, never the mean of the replicas' accuracies.

Example:
    >>> metric = Accuracy()
    >>> state = metric.state(logits, labels)       # tensor([correct, examples]) on one replica
    >>> metric.result(state_summed_over_replicas)  # correct / examples
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from stratagem.errors import InputError


class Metric(abc.ABC):
    """A metric as a vector of sums (`state`) and a function of the summed vector (`result`).

    A subclass sets `name` and `state_size` and implements both methods; states must be sums
    over examples, so that adding two replicas' states gives the state of their union.

    Example:
        >>> class MeanPrediction(Metric):
        ...     name, state_size = "mean_prediction", 2
        ...     def state(self, outputs, targets):
        ...         return torch.stack([outputs.sum(), torch.tensor(float(outputs.numel()))])
        ...     def result(self, totals):
        ...         return float(totals[0] / totals[1])
    """

    name: str
    state_size: int

    @abc.abstractmethod
    def state(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sums over this replica's examples: a 1-D tensor of `state_size` values."""

    @abc.abstractmethod
    def result(self, totals: torch.Tensor) -> float:
        """The metric from the state summed over every replica, worker and step."""


class _Mean(Metric):
    """A mean over examples (or elements): the state is their sum and their count, the result the ratio (NaN
    when nothing was counted)."""

    state_size = 2

    def result(self, totals: torch.Tensor) -> float:
        return _ratio(totals[0], totals[1])


class Accuracy(_Mean):
    """Share of examples whose predicted class (argmax over dim 1) equals the integer target."""

    name = "accuracy"

    def state(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if outputs.dim() < 2:
            raise InputError(
                "accuracy needs scores of shape (batch, classes) to take the argmax over classes. "
                f"Received: outputs of shape {tuple(outputs.shape)}. Use BinaryAccuracy for one score per example."
            )
        correct = (outputs.argmax(dim=1) == targets).sum()
        return torch.stack([correct.to(torch.float64), _count(targets)])


class BinaryAccuracy(_Mean):
    """Share of examples whose score (a logit) is on the side of 0 that its 0/1 target says."""

    name = "binary_accuracy"

    def state(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        predicted = (outputs.reshape(targets.shape) > 0).to(targets.dtype)
        correct = (predicted == targets).sum()
        return torch.stack([correct.to(torch.float64), _count(targets)])


class MeanSquaredError(_Mean):
    """Mean over every element of (output - target) squared."""

    name = "mse"

    def state(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        diff = outputs.to(torch.float64) - targets.to(torch.float64).reshape(outputs.shape)
        return torch.stack(
            [(diff * diff).sum(), torch.tensor(float(diff.numel()), dtype=torch.float64, device=diff.device)]
        )


class MeanAbsoluteError(_Mean):
    """Mean over every element of |output - target|."""

    name = "mae"

    def state(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        diff = outputs.to(torch.float64) - targets.to(torch.float64).reshape(outputs.shape)
        return torch.stack(
            [diff.abs().sum(), torch.tensor(float(diff.numel()), dtype=torch.float64, device=diff.device)]
        )


METRICS: dict[str, type[Metric]] = {
    "accuracy": Accuracy,
    "binary_accuracy": BinaryAccuracy,
    "mse": MeanSquaredError,
    "mae": MeanAbsoluteError,
}
"""Metrics by the name `fit(metrics=[...])` accepts."""


def get_metrics(metrics: Sequence[str | Metric] | None) -> list[Metric]:
    """`Metric` objects for names or objects; names must be in `METRICS` and distinct.

    Raises:
        InputError: an unknown name, something that is not a metric, or two metrics with one name.
    """
    if metrics is None:
        return []
    if isinstance(metrics, (str, Metric)):
        metrics = [metrics]
    out: list[Metric] = []
    for metric in metrics:
        if isinstance(metric, str):
            if metric not in METRICS:
                raise InputError(
                    f"Unknown metric. Received: {metric!r}. Choose one of {', '.join(METRICS)}, "
                    "or pass a stratagem.train.Metric."
                )
            metric = METRICS[metric]()
        elif not isinstance(metric, Metric):
            raise InputError(f"A metric is a name or a stratagem.train.Metric. Received: {type(metric).__name__}.")
        out.append(metric)
    names = [m.name for m in out]
    duplicates = sorted({n for n in names if names.count(n) > 1} | ({"loss"} & set(names)))
    if duplicates:
        raise InputError(
            f"Metric names must be distinct and not 'loss' (fit always reports the loss). "
            f"Received: {names}. Give each metric its own name."
        )
    return out


class MetricSet:
    """The loss and the metrics of one fit or evaluation as ONE state vector per replica.

    Layout: ``[loss * examples, examples, *metric states]``, float64, so a single reduction per
    step combines everything.
    """

    def __init__(self, metrics: Sequence[Metric]) -> None:
        self.metrics = list(metrics)
        self.size = 2 + sum(m.state_size for m in self.metrics)

    @property
    def names(self) -> list[str]:
        return ["loss", *(m.name for m in self.metrics)]

    def state(
        self,
        outputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        mean_loss: torch.Tensor,
        *,
        num_examples: int | None = None,
    ) -> torch.Tensor:
        """This replica's state vector; a replica with an empty slice contributes zeros.

        `num_examples` counts the examples when there are no `targets` (a model that computes its own loss)."""
        if targets is None and self.metrics:
            raise InputError(
                f"Metrics {[m.name for m in self.metrics]} compare predictions with targets, but this batch has none. "
                "Received: a batch without targets (no (inputs, targets) pair, no 'labels' entry). Put the targets "
                "in the batch, or leave metrics out."
            )
        if outputs is None and self.metrics:
            raise InputError(
                f"Metrics {[m.name for m in self.metrics]} read the model's scores, but its output has none. Received: "
                "an output without .logits that is not a tensor. Return the scores as .logits, or leave metrics out."
            )
        device = mean_loss.device if targets is None else targets.device
        if num_examples is not None:
            num = num_examples
        else:
            assert targets is not None, "the callers without targets count the examples (num_examples)"
            num = targets.shape[0] if targets.dim() else 1
        if num == 0:
            # An empty slice (fewer examples than replicas): its mean loss is NaN and it has nothing to count.
            return torch.zeros(self.size, dtype=torch.float64, device=device)
        parts = [
            torch.stack(
                [
                    mean_loss.detach().to(torch.float64) * num,
                    torch.tensor(float(num), dtype=torch.float64, device=device),
                ]
            )
        ]
        for metric in self.metrics:
            assert outputs is not None and targets is not None  # with metrics, both were checked above
            part = metric.state(outputs, targets).to(torch.float64).reshape(-1)
            if part.numel() != metric.state_size:
                raise InputError(
                    f"Metric {metric.name!r} returned a state of {part.numel()} value(s). "
                    f"Received: state_size={metric.state_size}. Make state() return state_size sums."
                )
            parts.append(part.to(device))
        return torch.cat(parts)

    def results(self, totals: torch.Tensor | Sequence[float]) -> dict[str, float]:
        """Loss and metrics from the state summed over replicas, workers and steps."""
        totals = torch.as_tensor(totals, dtype=torch.float64)
        out = {"loss": _ratio(totals[0], totals[1])}
        start = 2
        for metric in self.metrics:
            out[metric.name] = float(metric.result(totals[start : start + metric.state_size]))
            start += metric.state_size
        return out


def _count(targets: torch.Tensor) -> torch.Tensor:
    return torch.tensor(float(targets.shape[0]), dtype=torch.float64, device=targets.device)


def _ratio(num: torch.Tensor, den: torch.Tensor) -> float:
    count = float(den)
    return float(num) / count if count > 0 else float("nan")
