"""One worker of tests/test_trace_sharded.py, run under `stratagem launch`: a ShardedStrategy (stage TR_STAGE,
default 3) trains a 3-layer MLP for TR_STEPS steps (default 6) inside `strategy.trace(TR_DIR)`, or, without
TR_DIR, with STRATAGEM_TRACE tracing the run. Prints one JSON line: {"rank", "steps"}.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

import stratagem as sg

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from workers.common import classify_traced  # noqa: E402


def main() -> int:
    torch.set_num_threads(1)
    env = os.environ
    # A unit per Linear at either stage (stage 2 would keep this small MLP as one unit): each traced by name.
    strategy = sg.ShardedStrategy(stage=int(env.get("TR_STAGE", "3")), units=(nn.Linear,), timeout=60)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    model, opt = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.01))
    steps = int(env.get("TR_STEPS", "6"))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(steps)]

    classify_traced(strategy, model, opt, data)
    print(json.dumps({"rank": strategy.cluster.rank, "steps": steps}), flush=True)
    strategy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
