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
from cases import build, make_batches, train_step  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from workers.common import save_per_rank, setting, sizes, strategy_for  # noqa: E402


def main() -> int:
    backend = setting("COMPILE_BACKEND")
    with strategy_for(1, 120.0, logical=False) as strategy:
        model, opt, shape = build("mlp", "adam", torch.float64)
        if setting("COMPILE_WHEN") == "before":
            model, opt = strategy.distribute(torch.compile(model, backend=backend), opt)
            distributed = model
        else:
            distributed, opt = strategy.distribute(model, opt)
            model = torch.compile(distributed, backend=backend)
        step = train_step(model, opt)
        for x, y in strategy.distribute_dataset(make_batches(shape, torch.float64, sizes=sizes("COMPILE_SIZES"))):
            strategy.run(step, args=(x, y))
        save_per_rank(
            {"state": distributed.state_dict(), "compiled_graphs": counters["aot_autograd"]["ok"]},
            strategy,
            "COMPILE_OUT",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
