"""One worker of the loss-weight test (tests/test_loss_weights.py), run under `stratagem launch`: trains
tests/loss_weight_cases.py both ways with one and then two local replicas, a new strategy each time."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from loss_weight_cases import train  # noqa: E402
from workers.common import chief_saves_each_case  # noqa: E402


def main() -> int:
    return chief_saves_each_case(
        {(local, way): local for local in (1, 2) for way in ("mean", "sum")},
        lambda strategy, case: train(strategy, case[1]),
    )


if __name__ == "__main__":
    sys.exit(main())
