"""A `fit` run with BackupAndRestore that can kill itself mid-training, for tests/test_backup_restore.py.

Run as a plain process (one_device, mirrored) or under `stratagem launch` (multi_worker).
Settings arrive as environment variables:

FIT_STRATEGY      one_device | mirrored | multi_worker
FIT_BACKUP        the backup directory
FIT_OUT           where the chief saves the final state, history and what it resumed from
FIT_SAVE_FREQ     BackupAndRestore's save_freq ("epoch" or a number of steps)
FIT_KILL_AFTER    SIGKILL this process after that step (first attempt only: STRATAGEM_RESTART_COUNT 0 or unset)
FIT_KILL_RANK     under multi_worker, the rank that kills itself (default 0, the chief)
FIT_DROPOUT       1: put a dropout layer before the model, so the random state must be restored too
FIT_PAUSE_AT      after that step (first attempt, the rank FIT_KILL_RANK), touch FIT_MARKER and wait for a signal
FIT_MARKER        the file touched when paused (the test then signals or kills this process)
FIT_GRACE         BackupAndRestore's grace_period
FIT_STUCK         seconds the paused step goes on after the signal (a step stuck on a lost worker, say)
"""

from __future__ import annotations

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F
from cases import build
from torch import nn

import stratagem as sg
from stratagem.devices import DeviceRegistry

NUM_EXAMPLES, BATCH_SIZE, DATA_SEED, SHUFFLE_SEED, EPOCHS = 40, 12, 3, 7, 2


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(DATA_SEED)
    return torch.randn(NUM_EXAMPLES, 6, generator=g, dtype=torch.float64), torch.randint(
        0, 4, (NUM_EXAMPLES,), generator=g
    )


def build_model(dropout: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, optimizer, _ = build("mlp", "sgd_momentum", torch.float64)
    if dropout:
        model = nn.Sequential(nn.Dropout(0.3), model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    return model, optimizer


class KillAfter(sg.callbacks.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, context, num_examples):
        if context.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class PauseAfter(sg.callbacks.Callback):
    """Stands still after a step until a signal comes: the test then knows where the run is when it signals."""

    def __init__(self, step: int, marker: str, stuck: float) -> None:
        self.step, self.marker, self.stuck = step, marker, stuck

    def on_train_batch_end(self, context, num_examples):
        if context.step == self.step:
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            signal.pause()  # returns once BackupAndRestore's handler has recorded the signal
            time.sleep(self.stuck)


def main() -> int:
    torch.set_num_threads(1)
    env = os.environ
    registry = DeviceRegistry()
    registry.set_logical_device_configuration("cpu", 2)
    kind = env["FIT_STRATEGY"]
    if kind == "one_device":
        strategy = sg.OneDeviceStrategy("cpu:0", registry=registry)
    elif kind == "mirrored":
        strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=registry)
    else:
        strategy = sg.MultiWorkerMirroredStrategy(["cpu:0"], timeout=60, registry=registry)
    rank = strategy.cluster.rank if kind == "multi_worker" else 0
    model, optimizer = build_model(env.get("FIT_DROPOUT") == "1")
    save_freq = env.get("FIT_SAVE_FREQ", "epoch")
    backup = sg.callbacks.BackupAndRestore(
        env["FIT_BACKUP"],
        save_freq=save_freq if save_freq == "epoch" else int(save_freq),
        grace_period=float(env.get("FIT_GRACE", "25")),
    )
    callbacks: list[sg.callbacks.Callback] = [backup]
    first_attempt = env.get("STRATAGEM_RESTART_COUNT", "0") == "0"
    if env.get("FIT_KILL_AFTER") and first_attempt and str(rank) == env.get("FIT_KILL_RANK", "0"):
        callbacks.append(KillAfter(int(env["FIT_KILL_AFTER"])))
    if env.get("FIT_PAUSE_AT") and first_attempt and str(rank) == env.get("FIT_KILL_RANK", "0"):
        callbacks.append(PauseAfter(int(env["FIT_PAUSE_AT"]), env["FIT_MARKER"], float(env.get("FIT_STUCK", "0"))))
    x, y = data()
    try:
        history = _fit(strategy, model, optimizer, x, y, callbacks)
    except sg.Preempted as stop:
        print(f"rank {rank} preempted: {stop}", flush=True)
        raise
    if rank == 0:
        torch.save(
            {
                "state": history.model.state_dict(),
                "history": [log.metrics for log in history.epochs],
                "num_examples": [log.num_examples for log in history.epochs],
                "restored_from": backup.restored_from,
            },
            env["FIT_OUT"],
        )
    print(f"rank {rank} done, restored from {backup.restored_from}", flush=True)
    strategy.close()
    return 0


def _fit(strategy, model, optimizer, x, y, callbacks):
    return sg.fit(
        strategy,
        model,
        optimizer,
        F.cross_entropy,
        (x, y),
        batch_size=BATCH_SIZE,
        seed=SHUFFLE_SEED,
        epochs=EPOCHS,
        metrics=["accuracy"],
        validation_data=(x, y),
        validation_batch_size=16,
        clip_grad_norm=1.0,
        callbacks=callbacks,
    )


if __name__ == "__main__":
    sys.exit(main())
