"""A model with frozen, sometimes-used and never-used parameters, its batches and the one-device reference
(shared by tests/test_unused_parameters.py and the multi-worker script tests/workers/mwms_unused.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Flagged rows use the auxiliary head. Step 0: the first rows only (the first replica's slice); step 1: none
# (no replica uses it: grad must stay None, so Adam's weight decay must not move it); step 2: the last rows
# only (the last replica's slice); step 3: every row.
SIZES = [8, 8, 8, 7]
FLAGGED = [range(0, 2), range(0, 0), "last2", "all"]


class AuxNet(nn.Module):
    """A frozen input layer, a body, a head, an auxiliary head used only for flagged rows, and a head never used."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 4)
        self.aux = nn.Linear(8, 1)
        self.never = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(torch.relu(self.frozen(x))))
        loss = F.cross_entropy(self.head(h), y)
        if bool(flag.any()):  # the auxiliary head runs only where some row of this slice is flagged
            loss = loss + (self.aux(h).squeeze(-1) ** 2 * flag).sum() / x.shape[0]
        return loss


def build(dtype: torch.dtype = torch.float64) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(7)
    model = AuxNet().to(dtype)
    # L2 weight decay moves a parameter whose gradient is zeros, and skips one whose gradient is None.
    return model, torch.optim.Adam(model.parameters(), lr=0.05, weight_decay=0.1)


def batches(dtype: torch.dtype = torch.float64) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for n, rows in zip(SIZES, FLAGGED):
        flag = torch.zeros(n, dtype=dtype)
        if rows == "all":
            flag[:] = 1
        elif rows == "last2":
            flag[-2:] = 1
        else:
            flag[list(rows)] = 1
        out.append((torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 4, (n,), generator=g), flag))
    return out


def train_reference(dtype: torch.dtype = torch.float64) -> tuple[dict[str, torch.Tensor], list[bool]]:
    """The plain loop: final state, and whether aux's gradient was None after each step's backward."""
    model, opt = build(dtype)
    aux_none = []
    for x, y, flag in batches(dtype):
        model(x, y, flag).backward()
        aux_none.append(model.aux.weight.grad is None)
        opt.step()
        opt.zero_grad()
    return model.state_dict(), aux_none


def train_with(strategy, dtype: torch.dtype = torch.float64) -> tuple[dict[str, torch.Tensor], list[list[bool]]]:
    """The same loop under `strategy`: final state, and per step each local replica's aux-grad-is-None."""
    model, opt = strategy.distribute(*build(dtype))

    def step(x, y, flag):
        model(x, y, flag).backward()
        none = model.aux.weight.grad is None and model.never.weight.grad is None
        opt.step()
        opt.zero_grad()
        return none

    aux_none = []
    for x, y, flag in strategy.distribute_dataset(batches(dtype)):
        aux_none.append(list(strategy.experimental_local_results(strategy.run(step, args=(x, y, flag)))))
    return model.state_dict(), aux_none
