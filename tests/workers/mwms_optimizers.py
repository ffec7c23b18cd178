"""One worker of the multi-worker optimizer test, run under `stratagem launch`: every torch.optim
first-order optimizer at once (tests/optimizer_cases.py), two local replicas per worker, a
LambdaLR stepped inside the step function. Settings arrive as environment variables:

MW_OUT      where the chief saves the final state (torch.save)
MW_LOCAL    local replicas per worker (logical CPU devices)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from cases import make_batches  # noqa: E402
from optimizer_cases import build_heads, heads_loss  # noqa: E402
from workers.common import multi_worker, setting  # noqa: E402


def main() -> int:
    strategy = multi_worker(int(setting("MW_LOCAL", "2")), 60.0)
    model, optimizer = strategy.distribute(*build_heads())
    scheduler = strategy.distribute_scheduler(
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0 / (1 + epoch))
    )

    def step(x, y):
        heads_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()  # every local replica calls it; it must count once per global step

    for x, y in strategy.distribute_dataset(make_batches((6,), torch.float64)):
        strategy.run(step, args=(x, y))
    if strategy.cluster.rank == 0:
        torch.save(
            {"state": model.state_dict(), "last_epoch": scheduler.last_epoch, "explain": str(strategy.explain())},
            setting("MW_OUT"),
        )
    strategy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
