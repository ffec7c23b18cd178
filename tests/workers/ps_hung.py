"""A parameter-server training script for the hung-worker tests, run unchanged on every task.

Settings come from the environment: PS_TEST_STEPS (functions to schedule), PS_TEST_STEP_SLEEP (seconds each
step sleeps, so a test can stop a worker mid-step), PS_TEST_HEARTBEAT ("interval,timeout" in seconds, or
"default" for the coordinator's defaults), PS_TEST_RECOVERY (worker_recovery_timeout), PS_TEST_CLOSURE
(closure_timeout), PS_TEST_FREEZE ("worker:1,3,2.5": that worker stops itself with SIGSTOP 2.5 s into its 3rd
step, so the point of the freeze, and the heartbeat's silence at the closure deadline, does not depend on
when a test's signal lands) and PS_TEST_OUT: the chief writes there, as JSON, its losses (or the error join()
raised) and the coordinator's faults.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg

STEPS = int(os.environ.get("PS_TEST_STEPS", "40"))
OUT = os.environ.get("PS_TEST_OUT")
STEP_SLEEP = float(os.environ.get("PS_TEST_STEP_SLEEP", "0.2"))
HEARTBEAT = os.environ.get("PS_TEST_HEARTBEAT", "0.5,3")
RECOVERY = float(os.environ.get("PS_TEST_RECOVERY", "60"))
CLOSURE = os.environ.get("PS_TEST_CLOSURE")
FREEZE = os.environ.get("PS_TEST_FREEZE")
TASK = json.loads(os.environ["TF_CONFIG"])["task"]
NAME = f"{TASK['type']}:{TASK['index']}"
steps_here = 0


def make_dataset():
    g = torch.Generator().manual_seed(100 + TASK["index"])
    while True:
        x = torch.randn(16, 6, generator=g)
        yield x, (x.sum(dim=1) > 0).long()


torch.manual_seed(0)
net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
strategy = sg.ParameterServerStrategy(ps_exit_delay=0, chief_timeout=30)
model, optimizer = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.05))
beats = {}
if HEARTBEAT != "default":
    interval, timeout = (float(v) for v in HEARTBEAT.split(","))
    beats = {"heartbeat_interval": interval, "heartbeat_timeout": timeout}
if CLOSURE:
    beats["closure_timeout"] = float(CLOSURE)
coordinator = sg.ClusterCoordinator(strategy, worker_recovery_timeout=RECOVERY, **beats)
iterator = iter(coordinator.create_per_worker_dataset(make_dataset))


def train_step(iterator):
    global steps_here
    x, y = next(iterator)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    steps_here += 1
    print(f"step started on {NAME}", flush=True)
    if FREEZE:
        task, step, after = FREEZE.split(",")
        if task == NAME and steps_here == int(step):
            time.sleep(float(after))
            print(f"{NAME} stops itself (SIGSTOP) {after} s into its step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(STEP_SLEEP)
    print(f"step done on {NAME}", flush=True)
    return loss


losses = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(STEPS)]  # workers serve here
result: dict = {}
try:
    coordinator.join()
    result["losses"] = [float(loss.fetch()) for loss in losses]
except sg.ParameterServerError as exc:
    result["error"] = str(exc)
result["faults"] = [{"task": f.task, "kind": f.kind, "silent_s": f.silent_s, "at": f.at} for f in coordinator.faults]
result["explain"] = str(strategy.explain())
if OUT:
    with open(OUT, "w") as f:
        json.dump(result, f)
print(f"chief finished: {'error' if 'error' in result else len(result['losses'])}", flush=True)
strategy.shutdown()
sys.exit(3 if "error" in result else 0)
