"""Every torch.optim first-order optimizer in one model, for the multi-worker test (one launch for all):
a head per optimizer, and a user's `Optimizer` subclass that steps one torch optimizer per head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

optim = torch.optim
HEAD_OPTIMIZERS = {
    "sgd_nesterov": lambda groups: optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam_amsgrad": lambda groups: optim.Adam(groups, lr=0.01, amsgrad=True),
    "adamw": lambda groups: optim.AdamW(groups, lr=0.01, weight_decay=0.1),
    "radam": lambda groups: optim.RAdam(groups, lr=0.01),
    "nadam": lambda groups: optim.NAdam(groups, lr=0.01),
    "adamax": lambda groups: optim.Adamax(groups, lr=0.02),
    "adagrad": lambda groups: optim.Adagrad(groups, lr=0.1, lr_decay=0.01),
    "adadelta": lambda groups: optim.Adadelta(groups, lr=1.0),
    "rmsprop": lambda groups: optim.RMSprop(groups, lr=0.01, momentum=0.5, centered=True),
    "rprop": lambda groups: optim.Rprop(groups, lr=0.01),
    "asgd": lambda groups: optim.ASGD(groups, lr=0.05, t0=2),
}


class Heads(nn.Module):
    """One small MLP head per optimizer over the same input."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)) for _ in HEAD_OPTIMIZERS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([head(x) for head in self.heads])


class PerHead(torch.optim.Optimizer):
    """A user's optimizer whose __init__ takes other optimizers (not params and defaults); its one group's
    `lr` scales every inner optimizer's rates, so an LR scheduler built on it drives them all."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        super().__init__([p for o in optimizers for g in o.param_groups for p in g["params"]], {"lr": 1.0})
        self.optimizers = list(optimizers)

    def step(self, closure=None):
        factor = self.param_groups[0]["lr"]
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = group.setdefault("base_lr", group["lr"]) * factor
            optimizer.step()


def build_heads(dtype: torch.dtype = torch.float64) -> tuple[Heads, PerHead]:
    torch.manual_seed(42)
    model = Heads().to(dtype)
    optimizers = []
    for head, make in zip(model.heads, HEAD_OPTIMIZERS.values()):
        first, second = head[0], head[2]
        optimizers.append(
            make([{"params": list(first.parameters()), "lr": 0.02}, {"params": list(second.parameters())}])
        )
    return model, PerHead(optimizers)


def heads_loss(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return sum(F.cross_entropy(out, y) for out in outputs)
