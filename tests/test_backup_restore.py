"""BackupAndRestore: a run killed with SIGKILL mid-epoch and restarted ends with the parameters of an
uninterrupted run, for OneDevice, Mirrored (2 logical CPUs) and MultiWorkerMirrored (2 workers under
the launcher with max_restarts=1); the backup is gone once training finishes."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cases import TOL, train_reference
from conftest import cpu_registry
from workers.fit_resume import (
    BATCH_SIZE,
    EPOCHS,
    NUM_EXAMPLES,
    SHUFFLE_SEED,
    build_model,
    data,
)

import stratagem as sg
from stratagem import environ
from stratagem.cluster import launch

WORKER = str(Path(__file__).parent / "workers" / "fit_resume.py")
F64 = torch.float64
# 40 examples in batches of 12: 4 steps per epoch, 8 in all. Backups after steps 3 and 6; the kill
# after step 7 (epoch 2, batch 3) makes the restart resume mid-epoch at step 6 and redo step 7.
SAVE_FREQ, KILL_AFTER = 3, 7


def reference_state(dropout: bool = False, epochs: int = EPOCHS, lr_decay: float = 1.0) -> dict[str, torch.Tensor]:
    """A plain one-device loop over the documented order of ShuffledBatches: epoch e is
    torch.randperm(n) from a generator seeded seed * 1_000_003 + e + 1. The learning rate of
    epoch e is 0.1 * lr_decay ** e."""
    x, y = data()
    model, optimizer = build_model(dropout)
    for epoch in range(epochs):
        order = torch.randperm(
            NUM_EXAMPLES, generator=torch.Generator().manual_seed(SHUFFLE_SEED * 1_000_003 + epoch + 1)
        )
        optimizer.param_groups[0]["lr"] = 0.1 * lr_decay**epoch
        train_reference(model, optimizer, [(x[idx], y[idx]) for idx in order.split(BATCH_SIZE)])
    return model.state_dict()


def assert_matches(saved: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert saved.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(saved[key], value, **TOL[F64], msg=lambda m, k=key: f"{k}: {m}")


def run_worker(tmp_path: Path, kind: str, **settings: object) -> subprocess.CompletedProcess[bytes]:
    env = dict(environ.current())
    env.update(
        {
            "FIT_STRATEGY": kind,
            "FIT_BACKUP": str(tmp_path / "backup"),
            "FIT_OUT": str(tmp_path / "out.pt"),
            "FIT_SAVE_FREQ": str(SAVE_FREQ),
        }
    )
    env.update({k: str(v) for k, v in settings.items()})
    return subprocess.run([sys.executable, WORKER], env=env, capture_output=True, timeout=90, check=False)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind, dropout", [("one_device", True), ("mirrored", False)])
def test_a_killed_single_process_run_resumes_mid_epoch_and_ends_like_an_uninterrupted_one(tmp_path, kind, dropout):
    # Dropout only on one device: there the random state decides the masks, so restoring it is tested too
    # (mirrored replicas draw from one generator on two threads, in no fixed order).
    first = run_worker(tmp_path, kind, FIT_KILL_AFTER=KILL_AFTER, FIT_DROPOUT=int(dropout))
    assert first.returncode == -signal.SIGKILL, first.stderr.decode()[-3000:]
    assert (tmp_path / "backup" / "backup.pt").exists() and not (tmp_path / "out.pt").exists()
    second = run_worker(tmp_path, kind, FIT_DROPOUT=int(dropout))
    assert second.returncode == 0, second.stderr.decode()[-3000:]
    saved = torch.load(tmp_path / "out.pt")
    assert saved["restored_from"] == {"epoch": 1, "step": 6}
    assert not (tmp_path / "backup").exists()  # removed once training finished
    assert_matches(saved["state"], reference_state(dropout))
    assert saved["num_examples"] == [NUM_EXAMPLES] * EPOCHS
    if kind == "one_device":
        # The history too: the interrupted epoch's metric sums travelled in the backup.
        model, optimizer = build_model(dropout)
        x, y = data()
        uninterrupted = sg.fit(
            sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1)),
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
        )
        for got, expected in zip(saved["history"], (log.metrics for log in uninterrupted.epochs)):
            assert got.keys() == expected.keys()
            for name in expected:
                assert got[name] == pytest.approx(expected[name], rel=1e-12), name


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_multi_worker_run_whose_chief_is_killed_is_restarted_by_the_launcher_and_resumes(tmp_path):
    env = dict(environ.current())
    env.update(
        {
            "FIT_STRATEGY": "multi_worker",
            "FIT_BACKUP": str(tmp_path / "backup"),
            "FIT_OUT": str(tmp_path / "out.pt"),
            "FIT_SAVE_FREQ": str(SAVE_FREQ),
            "FIT_KILL_AFTER": str(KILL_AFTER),
        }
    )
    lines: list[str] = []
    result = launch(
        [sys.executable, WORKER],
        workers=2,
        env=env,
        max_restarts=1,
        timeout=150,
        grace_period=2,
        sink=lambda line: lines.append(f"[{line.task}] {line.text}"),
    )
    assert result.exit_code == 0, result.explain() + "\n" + "\n".join(lines[-40:])
    assert result.restarts == 1 and result.failures[0].task == "worker:0"
    assert "SIGKILL" in result.failures[0].reason
    saved = torch.load(tmp_path / "out.pt")
    assert saved["restored_from"] == {"epoch": 1, "step": 6}
    assert any("[worker:1] rank 1 done, restored from {'epoch': 1, 'step': 6}" in line for line in lines)
    assert not (tmp_path / "backup").exists()
    assert_matches(saved["state"], reference_state())


class FailAtStep(sg.callbacks.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, context, num_examples):
        if context.step == self.step:
            raise RuntimeError(f"failure at step {self.step}")


def _fit(backup, callbacks, strategy=None):
    model, optimizer = build_model(False)
    x, y = data()
    return sg.fit(
        strategy or sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1)),
        model,
        optimizer,
        F.cross_entropy,
        (x, y),
        batch_size=BATCH_SIZE,
        seed=SHUFFLE_SEED,
        epochs=EPOCHS,
        clip_grad_norm=1.0,
        callbacks=[backup, *callbacks],
    )


def test_epoch_backups_resume_at_the_start_of_the_interrupted_epoch(tmp_path):
    with pytest.raises(RuntimeError, match="failure at step 6"):
        _fit(sg.callbacks.BackupAndRestore(tmp_path / "b", save_freq="epoch"), [FailAtStep(6)])
    backup = sg.callbacks.BackupAndRestore(tmp_path / "b", save_freq="epoch")
    history = _fit(backup, [])
    assert backup.restored_from == {"epoch": 1, "step": 4}
    assert [log.epoch for log in history.epochs] == [1, 2]
    assert_matches(history.model.state_dict(), reference_state())
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("kind", ["one_device", "mirrored"])
def test_adam_resumes_exactly_from_a_mid_epoch_backup(tmp_path, kind):
    # Adam keeps a step count per parameter: a restore that miscounts it changes every later update.
    def run(callbacks):
        model, _ = build_model(False)
        strategy = (
            sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1))
            if kind == "one_device"
            else sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
        )
        x, y = data()
        try:
            return sg.fit(
                strategy,
                model,
                torch.optim.Adam(model.parameters(), lr=0.01),
                F.cross_entropy,
                (x, y),
                batch_size=BATCH_SIZE,
                seed=SHUFFLE_SEED,
                epochs=EPOCHS,
                callbacks=callbacks,
            )
        finally:
            strategy.close()

    with pytest.raises(RuntimeError, match="failure at step 7"):
        run([sg.callbacks.BackupAndRestore(tmp_path / "b", save_freq=SAVE_FREQ), FailAtStep(7)])
    resumed = run([sg.callbacks.BackupAndRestore(tmp_path / "b", save_freq=SAVE_FREQ)])
    uninterrupted = run([])
    assert_matches(resumed.model.state_dict(), uninterrupted.model.state_dict())


def test_a_learning_rate_schedule_resumes_with_the_run(tmp_path):
    def run(with_schedule: bool, *extra):
        model, optimizer = build_model(False)
        strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
        model, optimizer = strategy.distribute(model, optimizer)  # the scheduler must adjust this optimizer
        schedule = [sg.callbacks.LearningRateScheduler(torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5))]
        x, y = data()
        try:
            return sg.fit(
                strategy,
                model,
                optimizer,
                F.cross_entropy,
                (x, y),
                batch_size=BATCH_SIZE,
                seed=SHUFFLE_SEED,
                epochs=3,
                clip_grad_norm=1.0,
                callbacks=[*(schedule if with_schedule else []), *extra],
            )
        finally:
            strategy.close()

    with pytest.raises(RuntimeError, match="failure at step 6"):
        run(True, sg.callbacks.BackupAndRestore(tmp_path / "b"), FailAtStep(6))
    with pytest.raises(
        sg.InputError, match=r"The backup holds the state of callbacks \['0:LearningRateScheduler'\] but"
    ):
        run(False, sg.callbacks.BackupAndRestore(tmp_path / "b"))
    resumed = run(True, sg.callbacks.BackupAndRestore(tmp_path / "b"))
    assert_matches(resumed.model.state_dict(), reference_state(epochs=3, lr_decay=0.5))


def test_a_scheduler_of_an_optimizer_fit_does_not_train_with_is_refused():
    model, optimizer = build_model(False)
    _, unrelated = build_model(False)  # a scheduler on the optimizer fit distributes is taken (test_schedulers.py)
    schedule = sg.callbacks.LearningRateScheduler(torch.optim.lr_scheduler.StepLR(unrelated, 1))
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    x, y = data()
    try:
        with pytest.raises(sg.InputError, match=r"The scheduler adjusts an optimizer that fit does not train with"):
            sg.fit(strategy, model, optimizer, F.cross_entropy, (x, y), batch_size=BATCH_SIZE, callbacks=[schedule])
    finally:
        strategy.close()
    with pytest.raises(sg.InputError, match=r"needs a torch.optim.lr_scheduler scheduler. Received: float"):
        sg.callbacks.LearningRateScheduler(0.1)
    with pytest.raises(sg.InputError, match=r"interval must be 'epoch' or 'step'. Received: interval='batch'"):
        sg.callbacks.LearningRateScheduler(torch.optim.lr_scheduler.StepLR(optimizer, 1), interval="batch")


class OneOfTwoWorkers(sg.OneDeviceStrategy):
    """This process as worker 0 of two whose peer restored nothing: the peer adds zeros to every sum."""

    def input_pipeline(self):
        return 2, 0

    @property
    def num_replicas_in_sync(self):
        return 2

    def cross_worker_sum(self, tensor):
        return tensor + torch.zeros_like(tensor)  # the peer's contribution: step 0


def test_workers_that_restored_different_backups_are_refused(tmp_path):
    with pytest.raises(RuntimeError, match="failure at step 3"):
        _fit(sg.callbacks.BackupAndRestore(tmp_path / "b", save_freq=1), [FailAtStep(3)])
    strategy = OneOfTwoWorkers("cpu:0", registry=cpu_registry(1))
    with pytest.raises(
        sg.InputError,
        match=r"The workers start from different steps: process 0 is at step 2, the mean "
        r"over the 2 workers is 1. Received: backups that differ between workers",
    ):
        _fit(sg.callbacks.BackupAndRestore(tmp_path / "b", save_freq=1), [], strategy=strategy)


def test_keeping_the_backup_and_a_directory_with_other_files(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("mine")
    _fit(sg.callbacks.BackupAndRestore(tmp_path / "b", save_freq=2), [])
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["notes.txt"]  # only the backup went
    kept = sg.callbacks.BackupAndRestore(tmp_path / "k", save_freq=2, delete_checkpoint=False)
    _fit(kept, [])
    assert kept.path.exists()
    # A finished run's backup restores to the end: nothing is trained again.
    again = sg.callbacks.BackupAndRestore(tmp_path / "k", save_freq=2, delete_checkpoint=False)
    history = _fit(again, [])
    assert again.restored_from == {"epoch": EPOCHS - 1, "step": 8}
    assert_matches(history.model.state_dict(), reference_state())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"backup_dir": "", "save_freq": "epoch"}, r"backup_dir must be a directory path. Received: backup_dir=''"),
        (
            {"backup_dir": "b", "save_freq": 0},
            r"save_freq must be 'epoch' or a positive number of steps. Received: save_freq=0",
        ),
        ({"backup_dir": "b", "save_freq": "batch"}, r"Received: save_freq='batch'"),
    ],
)
def test_bad_backup_settings_are_refused(tmp_path, monkeypatch, kwargs, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(sg.InputError, match=message):
        sg.callbacks.BackupAndRestore(**kwargs)


def test_a_backup_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(sg.InputError, match=r"backup_dir must be a directory. Received: .*which is a file"):
        sg.callbacks.BackupAndRestore(tmp_path / "f")


def test_a_backup_dir_another_rank_renames_while_this_one_checks_it_is_not_taken_for_a_file(tmp_path, monkeypatch):
    # Ranks make the callback at the same time; another rank's save may rename the directory at any moment. A
    # directory that disappears between two looks is no file: the setting is accepted (the first save makes it).
    target = tmp_path / "backups"
    target.mkdir()
    plain_is_dir, plain_exists = Path.is_dir, Path.exists

    def exists_then_gone(path: Path, *args, **kwargs) -> bool:
        found = plain_exists(path, *args, **kwargs)
        if path == target and found:
            target.rename(tmp_path / "moved")  # the other rank's rename, right after this rank looked
        return found

    monkeypatch.setattr(Path, "exists", exists_then_gone)
    monkeypatch.setattr(Path, "is_dir", lambda path, *a, **k: plain_is_dir(path, *a, **k))
    callback = sg.callbacks.BackupAndRestore(target)
    assert callback.backup_dir == target
