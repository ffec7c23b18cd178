"""A small LSTM trained on `(seq, batch)` inputs with its hidden state carried across batches, on one device
(strategy None) or under a strategy through `strategy.step(batch_dims=1, returns="per_replica")`; and without
a carried state from `strategy.distribute_dataset(batches, batch_dim=1)`. Shared by tests/test_batch_dims.py
and tests/workers/mwms_batch_dims.py."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SEQ, BATCH, FEATURES, HIDDEN, CLASSES = 5, 7, 3, 4, 3
LR = 0.5


class TinyLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(FEATURES, HIDDEN)
        self.out = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]) -> Any:
        output, hidden = self.rnn(x, hidden)
        return self.out(output), hidden


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return TinyLSTM().double()


def batches(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [
        (
            torch.randn(SEQ, BATCH, FEATURES, generator=g, dtype=torch.float64),
            torch.randint(0, CLASSES, (SEQ, BATCH), generator=g),
        )
        for _ in range(steps)
    ]


def init_hidden() -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(1, BATCH, HIDDEN, dtype=torch.float64), torch.zeros(1, BATCH, HIDDEN, dtype=torch.float64))


def train(strategy: Any) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Three steps of SGD written by hand; the final parameters and each step's mean loss."""
    model = make_model()
    if strategy is not None:
        model = strategy.distribute(model)

    def step(data: torch.Tensor, targets: torch.Tensor, hidden: Any) -> Any:
        hidden = tuple(h.detach() for h in hidden)
        model.zero_grad()
        output, hidden = model(data, hidden)
        loss = F.cross_entropy(output.reshape(-1, CLASSES), targets.reshape(-1))
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        return loss.detach(), hidden

    if strategy is not None:
        step = strategy.step(step, batch_dims=1, returns="per_replica")
    hidden: Any = init_hidden()
    losses = []
    for data, targets in batches():
        loss, hidden = step(data, targets, hidden)
        losses.append(float(loss if strategy is None else strategy.reduce("mean", loss)))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, losses


def train_from_dataset(strategy: Any) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Three steps from `distribute_dataset(..., batch_dim=1)` and `run`, each from a zero state."""
    model = make_model()
    if strategy is not None:
        model = strategy.distribute(model)

    def step(data: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        model.zero_grad()
        zeros = torch.zeros(1, data.shape[1], HIDDEN, dtype=torch.float64)
        output, _ = model(data, (zeros, zeros))
        loss = F.cross_entropy(output.reshape(-1, CLASSES), targets.reshape(-1))
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        return loss.detach()

    losses = []
    if strategy is None:
        losses = [step(data, targets).item() for data, targets in batches()]
    else:
        for data, targets in strategy.distribute_dataset(batches(), batch_dim=1):
            losses.append(float(strategy.reduce("mean", strategy.run(step, args=(data, targets)))))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, losses
