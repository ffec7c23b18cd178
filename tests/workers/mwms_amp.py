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
from amp_cases import overflow_batches, train_bf16, train_scaled  # noqa: E402
from cases import make_batches  # noqa: E402
from workers.common import chief_saves_each_case  # noqa: E402


def train(strategy, case):
    _, kind = case
    if kind == "bf16":
        return train_bf16(strategy, make_batches((6,), torch.float32))
    return train_scaled(strategy, overflow_batches())


def main() -> int:
    return chief_saves_each_case({(local, kind): local for local in (1, 2) for kind in ("bf16", "scaled")}, train)


if __name__ == "__main__":
    sys.exit(main())
