"""One worker of the multi-worker BatchNorm and empty-slice test, run under `stratagem launch`.

Two local replicas per worker; the global batches include one of two examples, so every
replica of worker 1 has an empty slice in that step. Each rank saves what it
ends with to MW_OUT.<rank>: its state_dict, its optimizer state, the batch sizes its model saw,
its evaluation loss and explain().
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from cases import train_step  # noqa: E402
from torch import nn  # noqa: E402
from workers.common import save_per_rank, strategy_for  # noqa: E402

import stratagem as sg  # noqa: E402

SIZES = [6, 2, 3, 5]
"""Over 2 workers x 2 replicas: slices (2, 2, 1, 1), (1, 1, 0, 0), (1, 1, 1, 0), (2, 1, 1, 1)."""


class Net(nn.Module):
    """BatchNorm2d and BatchNorm1d, and a view-flatten that raises on an empty batch; notes each batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 4 * 4, 6, bias=False)
        self.norm1 = nn.BatchNorm1d(6, momentum=None)
        self.out = nn.Linear(6, 4)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.size(0))
        h = F.relu(self.norm(self.conv(x)))
        return self.out(F.relu(self.norm1(self.fc(h.view(h.size(0), -1)))))


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(5)
    model = Net().double()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def batches(sizes=SIZES, seed=3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn((n, 2, 4, 4), generator=g, dtype=torch.float64) + 1, torch.randint(0, 4, (n,), generator=g))
        for n in sizes
    ]


def main() -> int:
    with strategy_for(2, 60) as strategy:
        model, opt = strategy.distribute(*build())
        step = train_step(model, opt)
        for x, y in strategy.distribute_dataset(batches()):
            strategy.run(step, args=(x, y))
        evaluation = sg.evaluate(strategy, model, batches([7, 1], seed=4), F.cross_entropy, metrics=())
        save_per_rank(
            {
                "states": [r.state_dict() for r in model.replicas],
                "optimizer": opt.state_dict(),
                "seen": [list(r.seen) for r in model.replicas],
                "loss": evaluation.metrics["loss"],
                "explain": str(strategy.explain()),
            },
            strategy,
            "MW_OUT",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
