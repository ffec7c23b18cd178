"""One worker of the straggler tests (tests/test_multi_worker_stragglers.py), run under `stratagem launch`.
Settings arrive as environment variables:

ST_STEPS                  steps to train (default 40)
ST_SLOW_RANK, ST_SLOW_MS  this rank sleeps that long each step (default 50 ms)
ST_PHASE                  where it sleeps: "compute" (in the step function, default) or "input" (in its loader)
ST_STALL_STEP, ST_STALL_S the slow rank sleeps ST_STALL_S seconds inside that step instead (past the timeout)
ST_TIMEOUT                the strategy's timeout (default 60)
Prints one JSON line: {"rank", "steps", "stragglers": [Straggler.to_dict()...]} or {"rank", "error", "message"}.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg


def main() -> int:
    torch.set_num_threads(1)
    env = os.environ
    strategy = sg.MultiWorkerMirroredStrategy(timeout=float(env.get("ST_TIMEOUT", "60")))
    rank = strategy.cluster.rank
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    model, opt = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.01))
    steps = int(env.get("ST_STEPS", "40"))
    slow = env.get("ST_SLOW_RANK") == str(rank)
    pause = float(env.get("ST_SLOW_MS", "50")) / 1000
    phase = env.get("ST_PHASE", "compute")
    stall_step = int(env.get("ST_STALL_STEP", "-1"))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(8)]

    def batches():
        for i in range(steps):
            if slow and phase == "input":
                time.sleep(pause)
            yield data[i % len(data)]

    def train_step(x, y):
        if slow and strategy_step[0] == stall_step:
            time.sleep(float(env["ST_STALL_S"]))
        elif slow and phase == "compute":
            time.sleep(pause)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    strategy_step = [0]
    try:
        for x, y in strategy.distribute_dataset(batches()):
            strategy.run(train_step, args=(x, y))
            strategy_step[0] += 1
    except (sg.CollectiveTimeoutError, sg.ReplicaError) as exc:
        print(json.dumps({"rank": rank, "error": type(exc).__name__, "message": str(exc)}), flush=True)
        os._exit(3)  # the process group is broken: no orderly close
    print(
        json.dumps({"rank": rank, "steps": strategy_step[0], "stragglers": [s.to_dict() for s in strategy.stragglers]}),
        flush=True,
    )
    strategy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
