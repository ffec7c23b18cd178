"""One worker of the batch-dimension test (tests/test_batch_dims.py), run under `stratagem launch`: trains
tests/seq_batch_cases.py both ways (a step with batch_dims, a dataset with batch_dim) with one and then two
local replicas per worker, a new strategy each time."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from seq_batch_cases import train, train_from_dataset  # noqa: E402
from workers.common import chief_saves_each_case  # noqa: E402


def main() -> int:
    ways = {"step": train, "dataset": train_from_dataset}
    return chief_saves_each_case(
        {(way, local): local for way in ways for local in (1, 2)}, lambda strategy, case: ways[case[0]](strategy)
    )


if __name__ == "__main__":
    sys.exit(main())
