"""Checkpoints: atomic writes (a process killed between write and rename leaves the previous one),
random states, the resumable data source, and the errors of a checkpoint that does not fit."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_registry
from torch.utils.data import TensorDataset

import stratagem as sg
from stratagem.data import ShuffledBatches
from stratagem.train import (
    BackupAndRestore,
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from stratagem.train.checkpoint import remove_stale_temporaries

pytestmark = pytest.mark.timeout(60)


def test_a_checkpoint_round_trips_model_and_optimizer_and_leaves_no_temporary(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    path = save_checkpoint(
        tmp_path / "run" / "state.pt", {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 7}
    )
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.pt"]
    state = load_checkpoint(path)
    assert state["step"] == 7 and state["format"] == "stratagem-checkpoint"
    for key, value in model.state_dict().items():
        assert torch.equal(state["model"][key], value)
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


# Writes checkpoint 1, then makes os.replace kill the process, as a crash between write and rename would.
CRASH_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import torch
    from stratagem.train import save_checkpoint
    path = sys.argv[1]
    save_checkpoint(path, {"step": 1, "weights": torch.ones(1000)})
    def die(*args):
        os.kill(os.getpid(), signal.SIGKILL)
    os.replace = die
    save_checkpoint(path, {"step": 2, "weights": torch.full((1000,), 2.0)})
""")


def test_a_process_killed_between_write_and_rename_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "state.pt"
    result = subprocess.run(
        [sys.executable, "-c", CRASH_SCRIPT, str(path)], capture_output=True, timeout=60, check=False
    )
    assert result.returncode == -9, result.stderr.decode()
    state = load_checkpoint(path)
    assert state["step"] == 1 and torch.equal(state["weights"], torch.ones(1000))
    leftovers = [p for p in tmp_path.iterdir() if p.name != "state.pt"]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(
        ".stratagem-partial.state.pt."
    )  # the unfinished second write
    assert remove_stale_temporaries(tmp_path) == leftovers
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]


def test_loading_a_missing_or_foreign_file_says_what_it_is(tmp_path):
    with pytest.raises(sg.InputError, match=r"No checkpoint at .*nothing.pt"):
        load_checkpoint(tmp_path / "nothing.pt")
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(sg.InputError, match=r"is not a readable checkpoint"):
        load_checkpoint(tmp_path / "garbage.pt")
    torch.save({"weights": torch.ones(2)}, tmp_path / "plain.pt")
    with pytest.raises(sg.InputError, match=r"is not a stratagem checkpoint. Received: format=None"):
        load_checkpoint(tmp_path / "plain.pt")
    with pytest.raises(sg.InputError, match=r"A checkpoint is a dict of state. Received: list"):
        save_checkpoint(tmp_path / "x.pt", [1, 2])  # type: ignore[arg-type]


def test_random_states_are_restored_through_a_checkpoint_file(tmp_path):
    torch.manual_seed(11)
    random.seed(12)
    np.random.seed(13)
    torch.rand(5), random.random(), np.random.rand(2)  # move every generator away from its seed
    save_checkpoint(tmp_path / "rng.pt", {"rng": capture_rng_state()})
    expected = (torch.rand(5), random.random(), np.random.rand(3), np.random.randn(1))
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    restore_rng_state(load_checkpoint(tmp_path / "rng.pt")["rng"])
    got = (torch.rand(5), random.random(), np.random.rand(3), np.random.randn(1))
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1]
    assert np.array_equal(got[2], expected[2]) and np.array_equal(got[3], expected[3])


# ---- the resumable data source -------------------------------------------------------------------


def _data(n=10):
    return torch.arange(n, dtype=torch.float64)[:, None], torch.arange(n)


def test_shuffled_batches_depend_only_on_seed_and_epoch_and_resume_mid_epoch():
    x, y = _data()
    source = ShuffledBatches((x, y), 3, seed=4)
    epoch0 = [b[1].tolist() for b in source]
    epoch1 = [b[1].tolist() for b in source]  # the next iteration is the next epoch
    assert [len(b) for b in epoch0] == [3, 3, 3, 1]
    assert sorted(i for b in epoch0 for i in b) == list(range(10)) and epoch0 != epoch1
    again = ShuffledBatches((x, y), 3, seed=4)
    again.set_position(1, 2)
    assert [b[1].tolist() for b in again] == epoch1[2:]
    restored = ShuffledBatches(TensorDataset(x, y), 3, seed=0)  # the seed comes from the state
    restored.load_state_dict({**source.state_dict(), "epoch": 0, "offset": 3})
    assert [b[1].tolist() for b in restored] == epoch0[3:]
    assert ShuffledBatches((x, y), 3, seed=5).state_dict()["seed"] == 5
    assert [b.tolist() for b in ShuffledBatches(y, 4, shuffle=False, drop_last=True)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ShuffledBatches(_data(), 0), r"batch_size must be a positive integer. Received: batch_size=0"),
        (lambda: ShuffledBatches(_data(), 2, seed=1.5), r"seed must be an integer. Received: seed=1.5"),
        (lambda: ShuffledBatches(_data(0), 2), r"needs at least one example. Received: an empty data set"),
        (lambda: ShuffledBatches((torch.ones(3), torch.ones(4)), 2), r"share their first \(example\) dimension"),
        (lambda: ShuffledBatches({"x": 1}, 2), r"needs a tensor, a tuple of tensors.*Received: dict"),
        (
            lambda: ShuffledBatches(torch.tensor(3.0), 2),
            r"A data tensor needs a first \(example\) dimension. Received: shape \(\)",
        ),
        (lambda: ShuffledBatches(_data(3), 4, drop_last=True), r"drop_last=True leaves no batch"),
        (lambda: ShuffledBatches(_data(), 3).set_position(0, 5), r"offset must be between 0 and the 4 batches"),
        (
            lambda: ShuffledBatches(_data(), 3).set_position(-1),
            r"epoch must be a non-negative integer. Received: epoch=-1",
        ),
        (
            lambda: ShuffledBatches(_data(), 3).load_state_dict(ShuffledBatches(_data(), 2).state_dict()),
            r"taken with batch_size=2 but this source has batch_size=3",
        ),
    ],
)
def test_shuffled_batches_refuse_bad_input(make, message):
    with pytest.raises(sg.InputError, match=message):
        make()


# ---- a backup that does not fit the run --------------------------------------------------------


def _backup_of(tmp_path, model, **fit_args):
    """Runs one epoch that fails at step 2, leaving the backup of step 1 behind; returns the backup directory."""

    class Fail(sg.callbacks.Callback):
        def on_train_batch_end(self, context, num_examples):
            if context.step == 2:
                raise RuntimeError("interrupted")

    backup = tmp_path / "backup"
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    with pytest.raises(RuntimeError, match="interrupted"):
        sg.fit(
            sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1)),
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            F.cross_entropy,
            (x, y),
            batch_size=4,
            callbacks=[BackupAndRestore(backup, save_freq=1), Fail()],
            **fit_args,
        )
    assert (backup / "backup.pt").exists()
    return backup, (x, y)


def test_a_backup_of_another_model_or_other_metrics_is_refused(tmp_path):
    backup, data = _backup_of(tmp_path, torch.nn.Linear(3, 2), metrics=["accuracy"])
    other = torch.nn.Linear(3, 5)
    with pytest.raises(sg.InputError, match=r"The backup does not fit this model or optimizer"):
        sg.fit(
            sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1)),
            other,
            torch.optim.SGD(other.parameters(), lr=0.1),
            F.cross_entropy,
            data,
            batch_size=4,
            metrics=["accuracy"],
            callbacks=[BackupAndRestore(backup)],
        )
    same = torch.nn.Linear(3, 2)
    with pytest.raises(
        sg.InputError, match=r"The backup tracked metrics \['loss', 'accuracy'\] but this run tracks \['loss'\]"
    ):
        sg.fit(
            sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1)),
            same,
            torch.optim.SGD(same.parameters(), lr=0.1),
            F.cross_entropy,
            data,
            batch_size=4,
            callbacks=[BackupAndRestore(backup)],
        )
    with pytest.raises(sg.InputError, match=r"taken with batch_size=4 but this source has batch_size=2"):
        sg.fit(
            sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1)),
            same,
            torch.optim.SGD(same.parameters(), lr=0.1),
            F.cross_entropy,
            data,
            batch_size=2,
            metrics=["accuracy"],
            callbacks=[BackupAndRestore(backup)],
        )


def test_a_checkpoint_not_written_by_fit_is_refused(tmp_path):
    save_checkpoint(tmp_path / "backup" / "backup.pt", {"model": {}})
    model = torch.nn.Linear(3, 2)
    with pytest.raises(sg.InputError, match=r"This checkpoint was not written by fit. Received: kind=None"):
        sg.fit(
            sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1)),
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            F.cross_entropy,
            (torch.randn(4, 3), torch.zeros(4, dtype=torch.int64)),
            batch_size=2,
            callbacks=[BackupAndRestore(tmp_path / "backup")],
        )
