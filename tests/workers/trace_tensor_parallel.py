"""One worker of tests/test_trace_tensor_parallel.py, run under `stratagem launch --workers 2`: a TensorParallelStrategy
on the mesh TR_MESH ("model": 2 workers on one `model` axis; "data": a ("data", "model") mesh of shape (2, 1)) trains
an MLP of two Linear layers, the first split by output features and the second by input features, for TR_STEPS steps
(default 4) inside `strategy.trace(TR_DIR)`, or, without TR_DIR, with STRATAGEM_TRACE tracing the run. Worker
TR_SLOW_RANK (if set) sleeps TR_SLOW_MS in its backward each step. Prints one JSON line: {"rank", "steps"}.
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
    """The identity, whose backward pass sleeps `ms` milliseconds (0: not at all): a straggler inside backward."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.ms = ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ms and x.requires_grad:
            x.register_hook(lambda grad: time.sleep(self.ms / 1000))
        return x


def main() -> int:
    torch.set_num_threads(1)
    env = os.environ
    shape, axes = ((2, 1), ("data", "model")) if env.get("TR_MESH") == "data" else ((2,), ("model",))
    layouts = sg.LayoutMap(sg.DeviceMesh(shape, axes))
    layouts[r"0\.weight"] = ("model", None)  # output features
    layouts[r"0\.bias"] = ("model",)
    layouts[r"3\.weight"] = (None, "model")  # input features: partial sums
    strategy = sg.TensorParallelStrategy(layouts, timeout=60)
    rank = strategy.cluster.rank
    slow_ms = float(env["TR_SLOW_MS"]) if env.get("TR_SLOW_RANK") == str(rank) else 0.0
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), SleepInBackward(slow_ms), nn.Linear(32, 4))
    model, opt = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.01))
    steps = int(env.get("TR_STEPS", "4"))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(steps)]

    classify_traced(strategy, model, opt, data)
    print(json.dumps({"rank": rank, "steps": steps}), flush=True)
    strategy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
