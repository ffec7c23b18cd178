"""One worker of the hand-written update test (tests/test_hand_written_updates.py), run under `stratagem launch`:
trains tests/hand_update_cases.py each way with one local replica per worker, and `p.data.add_` with two
(logical devices of one CPU, where replicas without an optimizer must not share parameters), a new strategy
each time."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hand_update_cases import WAYS, train  # noqa: E402
from workers.common import chief_saves_each_case  # noqa: E402


def main() -> int:
    cases = {(way, 1): 1 for way in WAYS} | {("data_add", 2): 2}
    return chief_saves_each_case(cases, lambda strategy, case: train(strategy, case[0]))


if __name__ == "__main__":
    sys.exit(main())
