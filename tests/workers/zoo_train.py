"""One worker of the model-zoo test under MultiWorkerMirroredStrategy (tests/test_models.py), started by
`stratagem launch`. Settings arrive as environment variables:

ZOO_MODEL     which model of tests/zoo.py to train (its real configuration)
ZOO_OUT       every rank saves {"state", "losses"} to ZOO_OUT.<rank> (torch.save)
ZOO_TIMEOUT   the strategy's timeout in seconds
ZOO_SIMPLE    1: the simple configuration of tests/zoo.py (SGD, no scheduler, no BatchNorm), to check the harness
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zoo  # noqa: E402
from workers.common import save_per_rank, setting, strategy_for  # noqa: E402


def main() -> int:
    with strategy_for(1, float(setting("ZOO_TIMEOUT", "60")), logical=False) as strategy:
        model, losses = zoo.train_with(strategy, setting("ZOO_MODEL"), simple=setting("ZOO_SIMPLE", "0") == "1")
        save_per_rank({"state": model.state_dict(), "losses": losses}, strategy, "ZOO_OUT")
    return 0


if __name__ == "__main__":
    sys.exit(main())
