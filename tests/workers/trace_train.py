"""One worker of the trace tests (tests/test_trace_multi_worker.py), run under `stratagem launch`.
Settings arrive as environment variables:

TR_STEPS                  steps to train (default 30)
TR_SLOW_RANK, TR_SLOW_MS  this rank sleeps that long each step (default 50 ms) ...
TR_PHASE                  ... inside its backward pass ("backward", default) or its data loading ("input")
TR_DIR                    trace the steps with `strategy.trace(TR_DIR)` (unset: STRATAGEM_TRACE traces the run)
TR_SHIFT_RANK, TR_SHIFT_MS  that rank's trace clock runs TR_SHIFT_MS ahead (an injected offset)
TR_MODE                   with TR_DIR: the trace's mode, "spans" (default) or "summary"
Prints one JSON line: {"rank", "steps"}.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn

import stratagem as sg

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from workers.common import classify_traced  # noqa: E402


class SleepInBackward(nn.Module):
    """The identity, whose backward pass sleeps `pause` seconds (0: not at all)."""

    def __init__(self, pause: float) -> None:
        super().__init__()
        self.pause = pause

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pause and x.requires_grad:
            x.register_hook(lambda grad: time.sleep(self.pause))
        return x


def main() -> int:
    torch.set_num_threads(1)
    env = os.environ
    strategy = sg.MultiWorkerMirroredStrategy(timeout=60)
    rank = strategy.cluster.rank
    slow = env.get("TR_SLOW_RANK") == str(rank)
    pause = float(env.get("TR_SLOW_MS", "50")) / 1000 if slow else 0.0
    phase = env.get("TR_PHASE", "backward")
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), SleepInBackward(pause if phase == "backward" else 0.0), nn.Linear(32, 4)
    )
    model, opt = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.01))
    steps = int(env.get("TR_STEPS", "30"))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(8)]

    def batches():
        for i in range(steps):
            if pause and phase == "input":
                time.sleep(pause)
            yield data[i % len(data)]

    shift = int(float(env.get("TR_SHIFT_MS", "0")) * 1e6) if env.get("TR_SHIFT_RANK") == str(rank) else 0
    clock = lambda: time.perf_counter_ns() + shift  # noqa: E731
    classify_traced(strategy, model, opt, batches(), clock=clock, mode=env.get("TR_MODE", "spans"))
    print(json.dumps({"rank": rank, "steps": steps}), flush=True)
    strategy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
