"""One worker of tests/test_multi_worker_index_shards.py, run under `stratagem launch --workers 2`.

Trains one model in three phases, each reading a data set that records which examples it was asked for:
a custom loop over a shuffling DataLoader, `sg.fit` on a map-style data set with a batch size, then
`sg.fit` on a shuffling DataLoader with accumulate_steps=2 and validation batches given as a list.
Each rank saves what its data sets were asked for, the parameters after each phase, the history and
`explain()` to MW_OUT with its rank appended.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset, IterableDataset  # noqa: E402

import stratagem as sg  # noqa: E402

NUM_EXAMPLES, BATCH_SIZE, LOADER_SEED, FIT_SEED, EPOCHS = 27, 8, 5, 9, 2


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return (
        torch.randn(NUM_EXAMPLES, 5, generator=g, dtype=torch.float64),
        torch.randn(NUM_EXAMPLES, 2, generator=g, dtype=torch.float64),
    )


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).to(torch.float64)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def loader_generator() -> torch.Generator:
    return torch.Generator().manual_seed(LOADER_SEED)


class Counting(Dataset):
    """A map-style data set that records every index it is asked for."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y, self.asked = x, y, []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        self.asked.append(int(index))
        return self.x[index], self.y[index]


class Stream(IterableDataset):
    def __iter__(self):
        yield from zip(*data())


def main() -> int:
    torch.set_num_threads(1)
    strategy = sg.MultiWorkerMirroredStrategy(["cpu:0"], timeout=60)
    rank = strategy.cluster.rank
    x, y = data()
    model, optimizer = build()
    model, optimizer = strategy.distribute(model, optimizer)

    def step(xb, yb):
        loss = F.mse_loss(model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    looped = Counting(x, y)
    loader = DataLoader(looped, batch_size=BATCH_SIZE, shuffle=True, generator=loader_generator())
    for _ in range(EPOCHS):
        for xb, yb in strategy.distribute_dataset(loader):
            strategy.run(step, args=(xb, yb))
    after_loop = {k: v.clone() for k, v in model.state_dict().items()}
    explain_loop = str(strategy.explain())

    fitted = Counting(x, y)
    history = sg.fit(
        strategy, model, optimizer, F.mse_loss, fitted, batch_size=BATCH_SIZE, seed=FIT_SEED, epochs=EPOCHS
    )
    explain_fit = str(strategy.explain())
    after_fit = {k: v.clone() for k, v in model.state_dict().items()}

    accumulated = Counting(x, y)
    loader = DataLoader(accumulated, batch_size=BATCH_SIZE, shuffle=True, generator=loader_generator())
    validation = [(x[:10], y[:10])]
    accumulating = sg.fit(
        strategy, model, optimizer, F.mse_loss, loader, epochs=1, accumulate_steps=2, validation_data=validation
    )
    explain_accumulate = str(strategy.explain())
    strategy.distribute_dataset(DataLoader(Stream(), batch_size=4))
    explain_stream = str(strategy.explain())
    torch.save(
        {
            "loop_asked": looped.asked,
            "fit_asked": fitted.asked,
            "after_loop": after_loop,
            "after_fit": after_fit,
            "losses": history.history["loss"],
            "accumulate_asked": accumulated.asked,
            "after_accumulate": model.state_dict(),
            "val_loss": accumulating.history["val_loss"],
            "explain_accumulate": explain_accumulate,
            "examples": [log.num_examples for log in history.epochs],
            "explain_loop": explain_loop,
            "explain_fit": explain_fit,
            "explain_stream": explain_stream,
        },
        f"{os.environ['MW_OUT']}.{rank}",
    )
    strategy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
