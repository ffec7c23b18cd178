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

import stratagem as sg  # noqa: E402
from cases import build, make_batches  # noqa: E402
from stratagem.devices import DeviceRegistry  # noqa: E402


def main() -> int:
    torch.set_num_threads(1)
    env = os.environ
    local, k = int(env["ACC_LOCAL"]), int(env["ACC_K"])
    registry = DeviceRegistry()
    registry.set_logical_device_configuration("cpu", max(local, 2))
    strategy = sg.MultiWorkerMirroredStrategy([f"cpu:{i}" for i in range(local)], timeout=60.0, registry=registry)
    try:
        model, opt, shape = build("mlp", "adam", torch.float64)
        model, opt = strategy.distribute(model, opt)

        def micro_step(x, y, last):
            F.cross_entropy(model(x), y).backward()
            if last:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()

        sizes = [int(n) for n in env["ACC_SIZES"].split(",")]
        batches = make_batches(shape, torch.float64, sizes=sizes)
        if env.get("ACC_FIT") == "1":
            history = sg.fit(strategy, model, opt, F.cross_entropy, batches, accumulate_steps=k, clip_grad_norm=1.0)
            torch.save({"state": history.model.state_dict(), "num_examples": history.epochs[0].num_examples},
                       f"{env['ACC_OUT']}.{strategy.cluster.rank}")
            return 0
        first_grad = None
        for i, (x, y) in enumerate(strategy.distribute_dataset(batches)):
            last = i % k == k - 1
            with contextlib.nullcontext() if last else strategy.no_sync():
                strategy.run(micro_step, args=(x, y, last))
            if i == 0:
                first_grad = next(model.parameters()).grad.clone()  # this worker's own, if nothing was combined
        torch.save({"state": model.state_dict(), "first_grad": first_grad}, f"{env['ACC_OUT']}.{strategy.cluster.rank}")
    finally:
        strategy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
