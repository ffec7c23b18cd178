"""A `fit` run with BackupAndRestore that stops after a step, for tests/test_backup_sharded.py's resume matrix.

Runs as a plain process (one_device, mirrored) or under `stratagem launch` (multi_worker, sharded).
Settings arrive as environment variables:

RM_STRATEGY     one_device | mirrored | multi_worker | sharded
RM_BACKUP       the backup directory (kept when training ends: delete_checkpoint=False)
RM_OUT          where the chief saves the final parameters (whole tensors) and what it resumed from
RM_STOP_AFTER   stop training after that step (the backups written before it stay)
RM_LOG          a directory: each rank writes the example indices of each step it trained on
RM_DTYPE        float64 (default) or float32
RM_ASYNC        1: BackupAndRestore(async_save=True)
RM_KILL_AT      a step: the chief's writer thread of that step's sharded backup waits until the chief logged the
                step after it (training went on), then kills its process (SIGKILL) before writing the manifest
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from stratagem.devices import DeviceRegistry

NUM_EXAMPLES, BATCH_SIZE, SHUFFLE_SEED, EPOCHS, SAVE_FREQ = 52, 13, 7, 3, 3


def data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs, and targets whose second column is the example's index (logged by the loss, not trained on)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(NUM_EXAMPLES, 5, generator=g, dtype=dtype)
    y = torch.randn(NUM_EXAMPLES, 1, generator=g, dtype=dtype)
    return x, torch.cat([y, torch.arange(NUM_EXAMPLES, dtype=dtype)[:, None]], dim=1)


def build_model(dtype: torch.dtype) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).to(dtype)
    return model, torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)


def loss_on(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target[:, :1])


class IndexLog(sg.callbacks.Callback):
    """The example indices each step of this rank trained on, written as JSON lines."""

    def __init__(self, path: str) -> None:
        self.path, self.pending = path, []

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.pending.extend(int(i) for i in target[:, 1].tolist())
        return loss_on(output, target)

    def on_train_batch_end(self, context, num_examples):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": context.step, "epoch": context.epoch, "indices": self.pending}) + "\n")
        self.pending = []


class StopAfter(sg.callbacks.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, context, num_examples):
        if context.step == self.step:
            context.stop_training = True


def whole(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)  # a DTensor shard: gathered on every rank (a collective)
    return (full() if full is not None else tensor).detach().clone()


def kill_before_manifest(step: int, log_path: str) -> None:
    """The chief's writer thread, about to write the manifest of `step`'s sharded backup (every rank's shards and
    the state are on disk), waits until this process logged step `step + 1`, then kills the process."""
    from stratagem.train.backup import sharded as sharded_backup

    write_manifest = sharded_backup.write_manifest

    def killing(directory, manifest):
        if manifest["step"] == step:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                with open(log_path) as f:
                    if any(json.loads(line)["step"] == step + 1 for line in f):
                        break
                time.sleep(0.05)
            print(f"killed while writing the backup of step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        write_manifest(directory, manifest)

    sharded_backup.write_manifest = killing


def main() -> int:
    torch.set_num_threads(1)
    env = os.environ
    dtype = getattr(torch, env.get("RM_DTYPE", "float64"))
    kind = env["RM_STRATEGY"]
    registry = DeviceRegistry()
    registry.set_logical_device_configuration("cpu", 2)
    if kind == "one_device":
        strategy = sg.OneDeviceStrategy("cpu:0", registry=registry)
    elif kind == "mirrored":
        strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=registry)
    elif kind == "multi_worker":
        strategy = sg.MultiWorkerMirroredStrategy(["cpu:0"], timeout=60, registry=registry)
    else:
        strategy = sg.ShardedStrategy(timeout=60)
    rank = strategy.input_pipeline()[1]
    model, optimizer = build_model(dtype)
    backup = sg.callbacks.BackupAndRestore(
        env["RM_BACKUP"], save_freq=SAVE_FREQ, delete_checkpoint=False, async_save=env.get("RM_ASYNC") == "1"
    )
    log = IndexLog(os.path.join(env["RM_LOG"], f"{kind}-{os.getpid()}-rank{rank}.jsonl"))
    if env.get("RM_KILL_AT") and rank == 0:
        kill_before_manifest(int(env["RM_KILL_AT"]), log.path)
    callbacks = [backup, log]
    if env.get("RM_STOP_AFTER"):
        callbacks.append(StopAfter(int(env["RM_STOP_AFTER"])))
    history = sg.fit(
        strategy,
        model,
        optimizer,
        log.loss,
        data(dtype),
        batch_size=BATCH_SIZE,
        seed=SHUFFLE_SEED,
        epochs=EPOCHS,
        callbacks=callbacks,
    )
    state = {name: whole(value) for name, value in history.model.state_dict().items()}
    if rank == 0:
        torch.save({"state": state, "restored_from": backup.restored_from}, env["RM_OUT"])
    print(f"rank {rank} done, restored from {backup.restored_from}", flush=True)
    strategy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
