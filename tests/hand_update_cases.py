"""A model distributed without an optimizer and updated by hand in the step function, three ways (as
pytorch/examples' word language model does with `p.data.add_`), trained on one device (strategy None) and
under a strategy. Shared by tests/test_hand_written_updates.py and tests/workers/mwms_hand_updates.py."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SIZES = [7, 6, 5]
LR = 0.3
WAYS = ("data_add", "no_grad_sub", "foreach")
IN_PLACE_WAYS = ("no_grad_sub", "add_", "foreach")
"""The ways that change the parameter objects themselves (not through `p.data`)."""


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [
        (torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)) for n in SIZES
    ]


def update(model: nn.Module, way: str) -> None:
    """One SGD step written by hand, the way `way` names."""
    params = [p for p in model.parameters() if p.grad is not None]
    if way == "data_add":
        for p in params:
            p.data.add_(p.grad, alpha=-LR)
    elif way == "no_grad_sub":
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
    elif way == "add_":
        with torch.no_grad():
            for p in params:
                p.add_(p.grad, alpha=-LR)
    else:
        with torch.no_grad():
            torch._foreach_add_(params, [p.grad for p in params], alpha=-LR)


def train(strategy: Any, way: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Three steps; the final parameters and each step's loss (one device when `strategy` is None)."""
    model = make_model()
    if strategy is not None:
        model = strategy.distribute(model)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        update(model, way)
        return loss.detach()

    losses = []
    for x, y in batches():
        if strategy is None:
            losses.append(step(x, y).item())
        else:
            result = strategy.step(step)(x, y)
            losses.append(result.item())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, losses
