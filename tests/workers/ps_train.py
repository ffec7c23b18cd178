"""A parameter-server training script run unchanged on every task (chief, workers, ps) by the tests.

Settings come from the environment: PS_TEST_STEPS (functions to schedule), PS_TEST_OUT (the chief
writes its losses there as JSON), PS_TEST_CHECKPOINT (restored when it exists, written at the end),
PS_TEST_STEP_SLEEP (seconds each step sleeps, so a test can kill a worker mid-training),
PS_TEST_PS_EXIT_DELAY and PS_TEST_CHIEF_TIMEOUT (the strategy's ps_exit_delay and chief_timeout).
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg

STEPS = int(os.environ.get("PS_TEST_STEPS", "30"))
OUT = os.environ.get("PS_TEST_OUT")
CHECKPOINT = os.environ.get("PS_TEST_CHECKPOINT")
STEP_SLEEP = float(os.environ.get("PS_TEST_STEP_SLEEP", "0"))
PS_EXIT_DELAY = float(os.environ.get("PS_TEST_PS_EXIT_DELAY", "5"))
CHIEF_TIMEOUT = float(os.environ.get("PS_TEST_CHIEF_TIMEOUT", "60"))
TASK = json.loads(os.environ["TF_CONFIG"])["task"]


def make_dataset():
    g = torch.Generator().manual_seed(100 + TASK["index"])
    w = torch.Generator().manual_seed(0)
    teacher = torch.randn(6, 4, generator=w)
    while True:
        x = torch.randn(32, 6, generator=g)
        yield x, (x @ teacher).argmax(dim=1)


torch.manual_seed(0)
net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 4))
strategy = sg.ParameterServerStrategy(
    partitioner=sg.FixedShardsPartitioner(2), ps_exit_delay=PS_EXIT_DELAY, chief_timeout=CHIEF_TIMEOUT
)
model, optimizer = strategy.distribute(net, torch.optim.Adam(net.parameters(), lr=0.02))
if CHECKPOINT and os.path.exists(CHECKPOINT):
    strategy.restore(CHECKPOINT)
coordinator = sg.ClusterCoordinator(strategy, worker_recovery_timeout=60)
iterator = iter(coordinator.create_per_worker_dataset(make_dataset))


def train_step(iterator):
    x, y = next(iterator)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    time.sleep(STEP_SLEEP)
    print(f"step done on {TASK['type']}:{TASK['index']}", flush=True)
    return loss


losses = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(STEPS)]  # workers serve here
coordinator.join()
values = [float(loss.fetch()) for loss in losses]
if CHECKPOINT:
    strategy.save(CHECKPOINT)
if OUT:
    with open(OUT, "w") as f:
        json.dump({"losses": values}, f)
print(f"chief finished {len(values)} steps", flush=True)
strategy.shutdown()
