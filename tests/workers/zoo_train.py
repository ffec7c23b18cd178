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

import torch  # noqa: E402

import stratagem as sg  # noqa: E402
import zoo  # noqa: E402


def main() -> int:
    torch.set_num_threads(1)
    env = os.environ
    strategy = sg.MultiWorkerMirroredStrategy(["cpu:0"], timeout=float(env.get("ZOO_TIMEOUT", "60")))
    try:
        model, losses = zoo.train_with(strategy, env["ZOO_MODEL"], simple=env.get("ZOO_SIMPLE") == "1")
        torch.save({"state": model.state_dict(), "losses": losses}, f"{env['ZOO_OUT']}.{strategy.cluster.rank}")
    finally:
        strategy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
