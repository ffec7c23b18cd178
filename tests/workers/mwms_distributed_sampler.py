"""One worker of tests/test_multi_worker_distributed_sampler.py, run under `stratagem launch --workers 2`.

A DDP script's loader: a DataLoader with a DistributedSampler built after the strategy (num_replicas and
rank left unset, so they are the workers'). With one and then two local replicas, a new strategy each
time: a custom loop over it (set_epoch each epoch, as DDP scripts do), then `sg.fit` over a DataLoader
whose batch sampler holds a DistributedSampler (accumulate_steps=1, then 2). The chief saves the
parameters after each, the epochs' example counts and `explain()`.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import BatchSampler, DataLoader, TensorDataset  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402
from workers.common import chief_saves_each_case  # noqa: E402

import stratagem as sg  # noqa: E402

# 27 examples over 2 workers: 14 each (one padded), batches of 3, 3, 3, 3, 2 per worker.
NUM_EXAMPLES, BATCH_SIZE, LOOP_SEED, FIT_SEED, EPOCHS = 27, 3, 4, 8, 2


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    return TensorDataset(
        torch.randn(NUM_EXAMPLES, 5, generator=g, dtype=torch.float64),
        torch.randn(NUM_EXAMPLES, 2, generator=g, dtype=torch.float64),
    )


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).to(torch.float64)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(strategy: sg.MultiWorkerMirroredStrategy, local: int) -> dict:
    model, optimizer = strategy.distribute(*build())

    def step(xb, yb):
        F.mse_loss(model(xb), yb).backward()
        optimizer.step()
        optimizer.zero_grad()

    data = dataset()
    sampler = DistributedSampler(data, shuffle=True, seed=LOOP_SEED)
    loader = DataLoader(data, batch_size=BATCH_SIZE, sampler=sampler)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for xb, yb in strategy.distribute_dataset(loader):
            strategy.run(step, args=(xb, yb))
    after_loop = {k: v.clone() for k, v in model.state_dict().items()}
    explain = str(strategy.explain())

    batches = BatchSampler(DistributedSampler(data, shuffle=True, seed=FIT_SEED), BATCH_SIZE, drop_last=False)
    history = sg.fit(
        strategy,
        model,
        optimizer,
        F.mse_loss,
        DataLoader(data, batch_sampler=batches),
        epochs=EPOCHS,
        accumulate_steps=local,
    )  # fit sets the sampler's epoch
    return {
        "after_loop": after_loop,
        "after_fit": model.state_dict(),
        "explain": explain,
        "examples": [log.num_examples for log in history.epochs],
    }


def main() -> int:
    return chief_saves_each_case({1: 1, 2: 2}, train)


if __name__ == "__main__":
    sys.exit(main())
