"""One worker of the torch.compile test under MultiWorkerMirroredStrategy (tests/test_compile.py), started by
`stratagem launch`. Settings arrive as environment variables:

COMPILE_OUT       every rank saves {"state", "compiled_graphs"} to COMPILE_OUT.<rank> (torch.save)
COMPILE_WHEN      "before" or "after" distribute
COMPILE_BACKEND   torch.compile's backend
COMPILE_SIZES     global batch sizes, comma-separated
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import stratagem as sg  # noqa: E402
from cases import build, make_batches  # noqa: E402


def main() -> int:
    torch.set_num_threads(1)
    env = os.environ
    backend = env["COMPILE_BACKEND"]
    sizes = [int(n) for n in env["COMPILE_SIZES"].split(",")]
    strategy = sg.MultiWorkerMirroredStrategy(["cpu:0"], timeout=120.0)
    try:
        model, opt, shape = build("mlp", "adam", torch.float64)
        if env["COMPILE_WHEN"] == "before":
            model, opt = strategy.distribute(torch.compile(model, backend=backend), opt)
            distributed = model
        else:
            distributed, opt = strategy.distribute(model, opt)
            model = torch.compile(distributed, backend=backend)

        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return loss

        for x, y in strategy.distribute_dataset(make_batches(shape, torch.float64, sizes=sizes)):
            strategy.run(step, args=(x, y))
        torch.save({"state": distributed.state_dict(), "compiled_graphs": counters["aot_autograd"]["ok"]},
                   f"{env['COMPILE_OUT']}.{strategy.cluster.rank}")
    finally:
        strategy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
