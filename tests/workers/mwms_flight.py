"""One worker of tests/test_flight_record.py, run under `stratagem launch`: a MultiWorkerMirrored job in which one
worker leaves out a collective the others make, or stops answering. Settings arrive as environment variables:

FL_SKIP_RANK   this rank skips the loss's cross-worker reduce at step FL_STEP (the chief-only-metric mistake)
FL_STALL_RANK  this rank sleeps FL_STALL_S seconds inside step FL_STEP instead (past the timeout)
FL_TIMEOUT     the strategy's timeout in seconds (default 3)
FL_LINGER_S    after its error, the chief waits this long before it exits (its store serves the others' reports)
Prints one JSON line: {"rank", "error", "message"} when a collective fails, else {"rank", "steps"}.
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
    strategy = sg.MultiWorkerMirroredStrategy(timeout=float(env.get("FL_TIMEOUT", "3")))
    rank = strategy.cluster.rank
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    model, opt = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.01))
    target = int(env.get("FL_STEP", "3"))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(8)]

    def train_step(x, y):
        if env.get("FL_STALL_RANK") == str(rank) and step == target:
            time.sleep(float(env.get("FL_STALL_S", "30")))
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step = 0
    try:
        for x, y in strategy.distribute_dataset(data):
            step += 1
            loss = strategy.run(train_step, args=(x, y))
            if not (env.get("FL_SKIP_RANK") == str(rank) and step == target):
                strategy.reduce("MEAN", loss)
    except (sg.CollectiveTimeoutError, sg.ReplicaError) as exc:
        print(json.dumps({"rank": rank, "error": type(exc).__name__, "message": str(exc)}), flush=True)
        if rank == 0:
            time.sleep(float(env.get("FL_LINGER_S", "0")))  # the store stays up while the others report
        os._exit(3)  # the process group is broken: no orderly close
    print(json.dumps({"rank": rank, "steps": step}), flush=True)
    strategy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
