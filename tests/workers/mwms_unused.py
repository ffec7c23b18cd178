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

from unused_cases import train_with  # noqa: E402
from workers.common import chief_saves_each_case  # noqa: E402


def train(strategy, local):
    state, aux_none = train_with(strategy)
    return {"state": state, "aux_none": aux_none}


def main() -> int:
    return chief_saves_each_case({local: local for local in (1, 2)}, train)


if __name__ == "__main__":
    sys.exit(main())
