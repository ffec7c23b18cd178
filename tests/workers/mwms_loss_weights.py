"""One worker of the loss-weight test (tests/test_loss_weights.py), run under `stratagem launch`: trains
tests/loss_weight_cases.py both ways with one and then two local replicas, a new strategy each time."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import stratagem as sg  # noqa: E402
from loss_weight_cases import train  # noqa: E402
from stratagem.devices import DeviceRegistry  # noqa: E402


def main() -> int:
    torch.set_num_threads(1)
    results = {}
    rank = None
    for local in (1, 2):
        for way in ("mean", "sum"):
            registry = DeviceRegistry()
            registry.set_logical_device_configuration("cpu", 2)
            strategy = sg.MultiWorkerMirroredStrategy([f"cpu:{i}" for i in range(local)], timeout=60,
                                                      registry=registry)
            rank = strategy.cluster.rank
            results[(local, way)] = train(strategy, way)
            strategy.close()
    if rank == 0:
        torch.save(results, os.environ["MW_OUT"])
    print(f"rank {rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
