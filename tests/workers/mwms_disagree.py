"""One worker of the disagreement tests (tests/test_multi_worker_agreement.py), run under `stratagem launch`.
Settings arrive as environment variables:

AG_MODE        "loader": a shuffled DataLoader over a map-style data set (cut at the index level);
               "batches": a list of global batches (each worker slices them); "step": `strategy.step`
AG_EVAL_CHIEF  1: the chief draws from torch's random stream before training (as an evaluation on the
               chief only does), which shifts its shuffle
AG_SHIFT_RANK  this rank builds its list of batches from another seed (AG_MODE "batches" or "step")
AG_CHECK       0: check_batches=False
AG_STEPS       how many steps to train (default 6)
AG_SHM         0: sum through Gloo (shared_memory=False); unset: the strategy's choice (shared memory here)
Prints one JSON line: {"error": class, "message": ...} or {"steps": n, "losses": [...]}.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg


def main() -> int:
    torch.set_num_threads(1)
    env = os.environ
    mode = env.get("AG_MODE", "loader")
    strategy = sg.MultiWorkerMirroredStrategy(
        timeout=60,
        check_batches=env.get("AG_CHECK", "1") != "0",
        shared_memory=False if env.get("AG_SHM") == "0" else None,
    )
    rank = strategy.cluster.rank
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    model, opt = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1))
    steps = int(env.get("AG_STEPS", "6"))
    seed = 1 if env.get("AG_SHIFT_RANK") == str(rank) else 0
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
    torch.manual_seed(0)
    if env.get("AG_EVAL_CHIEF") == "1" and rank == 0:
        torch.rand(1)  # an evaluation's shuffle on the chief only

    def train_step(xb, yb):
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    losses = []
    try:
        if mode == "loader":
            loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
            for i, (xb, yb) in enumerate(strategy.distribute_dataset(loader)):
                if i == steps:
                    break
                losses.append(float(strategy.reduce("mean", strategy.run(train_step, args=(xb, yb)))))
        elif mode == "batches":
            batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 64, 8)][:steps]
            for xb, yb in strategy.distribute_dataset(batches):
                losses.append(float(strategy.reduce("mean", strategy.run(train_step, args=(xb, yb)))))
        else:
            step = strategy.step(train_step)
            for i in range(steps):
                losses.append(float(strategy.reduce("mean", step(x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8]))))
    except sg.InputError as exc:
        print(json.dumps({"rank": rank, "error": type(exc).__name__, "message": str(exc)}), flush=True)
        strategy.close()
        return 3
    print(json.dumps({"rank": rank, "steps": len(losses), "losses": losses}), flush=True)
    strategy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
