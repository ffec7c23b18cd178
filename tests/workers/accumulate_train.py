"""One worker of the no_sync() accumulation test under MultiWorkerMirroredStrategy
(tests/test_accumulation.py), started by `stratagem launch`. Settings arrive as environment variables:

ACC_OUT      every rank saves {"state": final state_dict, "first_grad": a gradient after the first no_sync()
             run} to ACC_OUT.<rank> (torch.save)
ACC_LOCAL    local replicas per worker (logical CPU devices)
ACC_K        micro-batches per optimizer step
ACC_SIZES    global micro-batch sizes, comma-separated
ACC_FIT      1: train with sg.fit(..., accumulate_steps=ACC_K) instead of the hand-written loop
"""

from __future__ import annotations

import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from cases import build, make_batches  # noqa: E402
from workers.common import save_per_rank, setting, sizes, strategy_for  # noqa: E402

import stratagem as sg  # noqa: E402


def main() -> int:
    k = int(setting("ACC_K"))
    with strategy_for(int(setting("ACC_LOCAL")), 60.0) as strategy:
        model, opt, shape = build("mlp", "adam", torch.float64)
        model, opt = strategy.distribute(model, opt)

        def micro_step(x, y, last):
            F.cross_entropy(model(x), y).backward()
            if last:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()

        batches = make_batches(shape, torch.float64, sizes=sizes("ACC_SIZES"))
        if setting("ACC_FIT", "0") == "1":
            history = sg.fit(strategy, model, opt, F.cross_entropy, batches, accumulate_steps=k, clip_grad_norm=1.0)
            save_per_rank(
                {"state": history.model.state_dict(), "num_examples": history.epochs[0].num_examples},
                strategy,
                "ACC_OUT",
            )
            return 0
        first_grad = None
        for i, (x, y) in enumerate(strategy.distribute_dataset(batches)):
            last = i % k == k - 1
            with contextlib.nullcontext() if last else strategy.no_sync():
                strategy.run(micro_step, args=(x, y, last))
            if i == 0:
                first_grad = next(model.parameters()).grad.clone()  # this worker's own, if nothing was combined
        save_per_rank({"state": model.state_dict(), "first_grad": first_grad}, strategy, "ACC_OUT")
    return 0


if __name__ == "__main__":
    sys.exit(main())
