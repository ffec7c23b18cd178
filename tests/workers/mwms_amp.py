"""One worker of the mixed-precision test (tests/test_autocast.py), run under `stratagem launch`.

With one and then two local replicas per worker it trains tests/amp_cases.py's bf16 loop and its
loss-scaled loop (an inf in one worker's slice at step 1), each under a new MultiWorkerMirroredStrategy
(the previous one closed). The chief saves the states and the scales seen by its replicas to MW_OUT.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import stratagem as sg  # noqa: E402
from amp_cases import overflow_batches, train_bf16, train_scaled  # noqa: E402
from cases import make_batches  # noqa: E402
from stratagem.devices import DeviceRegistry  # noqa: E402


def main() -> int:
    torch.set_num_threads(1)
    results = {}
    rank = None
    for local in (1, 2):
        for kind in ("bf16", "scaled"):
            registry = DeviceRegistry()
            registry.set_logical_device_configuration("cpu", 2)
            strategy = sg.MultiWorkerMirroredStrategy([f"cpu:{i}" for i in range(local)], timeout=60,
                                                      registry=registry)
            rank = strategy.cluster.rank
            if kind == "bf16":
                results[(local, kind)] = train_bf16(strategy, make_batches((6,), torch.float32))
            else:
                results[(local, kind)] = train_scaled(strategy, overflow_batches())
            strategy.close()
    if rank == 0:
        torch.save(results, os.environ["MW_OUT"])
    print(f"rank {rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
