"""One worker of tests/test_trace_fit.py, run under `stratagem launch`: `sg.fit(..., trace=TR_DIR)` on a
MultiWorkerMirroredStrategy, a tiny MLP, TR_EPOCHS epochs of TR_STEPS global batches of 32; then one more epoch with
fit's default trace (summary mode, sampled, in memory).

Prints one JSON line: {"rank", "steps", "loss", "left_on": the default trace's steps, recorded steps, rows' tasks,
whether each row's parts add up to it}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from stratagem.train.callback import Callback


class NestedTrace(Callback):
    """Tries `strategy.trace(directory)` after the last step of the epoch; keeps the refusal's message."""

    def __init__(self, strategy: sg.MultiWorkerMirroredStrategy, directory: Path) -> None:
        self.strategy, self.directory, self.refusal = strategy, directory, None

    def on_epoch_end(self, context, log) -> None:
        try:
            with self.strategy.trace(self.directory):
                pass
        except sg.InputError as error:
            self.refusal = str(error)


def main() -> int:
    torch.set_num_threads(1)
    env = os.environ
    strategy = sg.MultiWorkerMirroredStrategy(timeout=60)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    steps, epochs = int(env.get("TR_STEPS", "6")), int(env.get("TR_EPOCHS", "2"))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(steps)]
    history = sg.fit(
        strategy, net, torch.optim.SGD(net.parameters(), lr=0.01), F.cross_entropy, data, epochs=epochs,
        trace=env["TR_DIR"],
    )  # fmt: skip
    rank = strategy.cluster.rank
    # Then one epoch with fit's default trace: summary mode on a sample of the steps, this worker's table in memory;
    # a trace of a range begun inside it, between two recorded steps, is refused.
    nested = NestedTrace(strategy, Path(env["TR_DIR"]) / "nested")
    again = sg.fit(
        strategy, history.model, history.optimizer, F.cross_entropy, data, epochs=1, callbacks=[nested]
    ).trace
    left_on = None
    if again is not None:
        rows = again.summary.rows
        left_on = {"num_steps": again.num_steps, "num_recorded": again.num_recorded, "tasks": [r.task for r in rows],
                   "adds_up": all(abs(r.parts_ms - r.step_ms) <= 0.02 * r.step_ms for r in rows)}  # fmt: skip
    print(
        json.dumps(
            {
                "rank": rank,
                "steps": steps * epochs,
                "loss": history.history["loss"][-1],
                "left_on": left_on,
                "nested": nested.refusal,
            }
        ),  # fmt: skip
        flush=True,
    )
    strategy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
