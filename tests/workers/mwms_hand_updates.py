"""One worker of the hand-written update test (tests/test_hand_written_updates.py), run under `stratagem launch`:
trains tests/hand_update_cases.py each way with one local replica per worker, a new strategy each time."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hand_update_cases import WAYS, train  # noqa: E402
from workers.common import chief_saves_each_case  # noqa: E402


def main() -> int:
    return chief_saves_each_case({way: 1 for way in WAYS}, lambda strategy, way: train(strategy, way))


if __name__ == "__main__":
    sys.exit(main())
