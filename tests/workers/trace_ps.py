"""One task of tests/test_trace_ps.py, run unchanged on every task under `stratagem launch --workers 2 --ps 1
--trace DIR`: a parameter-server job of TR_STEPS functions (default 12) over an MLP split in two shards per tensor.
worker:0's first function waits (up to 60 s) until worker:1 has run one, so that both workers run functions however
slowly worker:1's process starts (it touches the file TR_MARK). The chief prints one JSON line: {"rank": 0, "steps", "losses"}.
"""

from __future__ import annotations

import json
import os
import pathlib
import time

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg

STEPS = int(os.environ.get("TR_STEPS", "12"))
TASK = json.loads(os.environ["TF_CONFIG"])["task"]
MARK = pathlib.Path(os.environ["TR_MARK"])


def make_dataset():
    g = torch.Generator().manual_seed(100 + TASK["index"])
    while True:
        x = torch.randn(16, 6, generator=g)
        yield x, (x.sum(dim=1) > 0).long()


torch.set_num_threads(1)
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 2))
strategy = sg.ParameterServerStrategy(partitioner=sg.FixedShardsPartitioner(2), ps_exit_delay=30)
model, optimizer = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1))
coordinator = sg.ClusterCoordinator(strategy)
iterator = iter(coordinator.create_per_worker_dataset(make_dataset))


def train_step(iterator):
    x, y = next(iterator)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if TASK["index"] == 1:
        MARK.touch()
    else:
        deadline = time.monotonic() + 60
        while not MARK.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return loss


losses = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(STEPS)]  # workers serve here
coordinator.join()
print(json.dumps({"rank": 0, "steps": STEPS, "losses": [float(v.fetch()) for v in losses]}), flush=True)
strategy.shutdown()
