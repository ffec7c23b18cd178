"""One worker of tests/test_trace_fit.py, run under `stratagem launch`: `sg.fit(..., trace=TR_DIR)` on a
MultiWorkerMirroredStrategy, a tiny MLP, TR_EPOCHS epochs of TR_STEPS global batches of 32.

Prints one JSON line: {"rank", "steps", "loss"}.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg


def main() -> int:
    torch.set_num_threads(1)
    env = os.environ
    strategy = sg.MultiWorkerMirroredStrategy(timeout=60)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    steps, epochs = int(env.get("TR_STEPS", "6")), int(env.get("TR_EPOCHS", "2"))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(steps)]
    history = sg.fit(
        strategy, net, torch.optim.SGD(net.parameters(), lr=0.01), F.cross_entropy, data, epochs=epochs,
        trace=env["TR_DIR"],
    )  # fmt: skip
    rank = strategy.cluster.rank
    print(json.dumps({"rank": rank, "steps": steps * epochs, "loss": history.history["loss"][-1]}), flush=True)
    strategy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
