"""One worker of the unused-parameter test (tests/test_unused_parameters.py), run under `stratagem launch`.

It trains tests/unused_cases.py twice in one process, each time with a new MultiWorkerMirroredStrategy at
the same cluster address (the first closed before the second is built): first one local replica per worker
(the bucketed path), then two (local combination, then the sum across workers). The chief saves both
results to MW_OUT.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import stratagem as sg  # noqa: E402
from stratagem.devices import DeviceRegistry  # noqa: E402
from unused_cases import train_with  # noqa: E402


def main() -> int:
    torch.set_num_threads(1)
    results = {}
    rank = None
    for local in (1, 2):
        registry = DeviceRegistry()
        registry.set_logical_device_configuration("cpu", 2)
        strategy = sg.MultiWorkerMirroredStrategy([f"cpu:{i}" for i in range(local)], timeout=60, registry=registry)
        rank = strategy.cluster.rank
        state, aux_none = train_with(strategy)
        results[local] = {"state": state, "aux_none": aux_none}
        strategy.close()
    if rank == 0:
        torch.save(results, os.environ["MW_OUT"])
    print(f"rank {rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
