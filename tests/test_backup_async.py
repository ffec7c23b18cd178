"""BackupAndRestore(async_save=True): the backup a thread writes holds the step boundary's values (the same file
as a synchronous save's, while training went on), a failed background write is raised in training, and the
copies reuse their buffers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_registry
from workers.fit_resume import BATCH_SIZE, SHUFFLE_SEED, build_model, data

import stratagem as sg
from stratagem.train.backup import callback as callbacks_module
from stratagem.train.backup.writer import snapshot
from stratagem.train.checkpoint import load_checkpoint


def fit_with(backup: sg.callbacks.BackupAndRestore) -> None:
    model, optimizer = build_model(False)
    sg.fit(
        sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1)),
        model,
        optimizer,
        F.cross_entropy,
        data(),
        batch_size=BATCH_SIZE,
        seed=SHUFFLE_SEED,
        epochs=2,
        callbacks=[backup],
    )


def test_an_asynchronous_backup_holds_the_same_state_as_a_synchronous_one(tmp_path):
    for name, async_save in (("sync", False), ("async", True)):
        fit_with(
            sg.callbacks.BackupAndRestore(tmp_path / name, save_freq=3, async_save=async_save, delete_checkpoint=False)
        )
    for file in ("backup.pt", "backup.previous.pt"):
        sync, asynchronous = load_checkpoint(tmp_path / "sync" / file), load_checkpoint(tmp_path / "async" / file)
        assert asynchronous["step"] == sync["step"] and sync["step"] in (3, 6)
        for key, value in sync["model"].items():
            assert torch.equal(asynchronous["model"][key], value), (file, key)
        for index, entry in sync["optimizer"]["state"].items():
            for key, value in entry.items():
                assert torch.equal(asynchronous["optimizer"]["state"][index][key], value), (file, index, key)


def test_a_background_write_that_fails_is_raised_in_training_and_keeps_the_backups_before(tmp_path, monkeypatch):
    real = callbacks_module.save_checkpoint
    calls = []

    def failing_second(path, state, *, previous=None):
        calls.append(state["step"])
        if len(calls) == 2:
            raise sg.CheckpointWriteError(f"Cannot write the checkpoint {str(path)!r}: the file system is full.")
        return real(path, state, previous=previous)

    monkeypatch.setattr(callbacks_module, "save_checkpoint", failing_second)
    backup = sg.callbacks.BackupAndRestore(tmp_path / "b", save_freq=3, async_save=True, delete_checkpoint=False)
    with pytest.raises(sg.CheckpointWriteError, match="the file system is full"):
        fit_with(backup)
    assert calls == [3, 6]
    assert load_checkpoint(tmp_path / "b" / "backup.pt")["step"] == 3  # the backup before the failed one


def test_a_snapshot_copies_into_the_buffers_of_the_one_before_and_is_independent_of_the_original():
    live = {"w": torch.ones(3), "groups": [{"lr": 0.1}], "t": (torch.zeros(2), 5)}
    first = snapshot(live)
    live["w"].add_(1)
    assert torch.equal(first["w"], torch.ones(3))
    second = snapshot(live, first)
    assert second["w"] is first["w"] and torch.equal(second["w"], torch.full((3,), 2.0))
    assert second["t"][0] is first["t"][0] and second["t"][1] == 5 and second["groups"] == [{"lr": 0.1}]
    other = snapshot({"w": torch.ones(4)}, first)  # another shape: a new buffer
    assert other["w"] is not first["w"]


def test_a_backup_of_another_data_seed_is_refused_with_both_seeds_unless_allowed(tmp_path):
    def run(seed: int, **options: object) -> sg.callbacks.BackupAndRestore:
        model, optimizer = build_model(False)
        backup = sg.callbacks.BackupAndRestore(tmp_path / "b", save_freq=3, delete_checkpoint=False, **options)
        sg.fit(
            sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1)),
            model,
            optimizer,
            F.cross_entropy,
            data(),
            batch_size=BATCH_SIZE,
            seed=seed,
            epochs=2,
            callbacks=[backup],
        )
        return backup

    run(SHUFFLE_SEED)
    with pytest.raises(sg.InputError) as refused:
        run(SHUFFLE_SEED + 1)
    assert f"shuffled with seed={SHUFFLE_SEED} but this run's are shuffled with seed={SHUFFLE_SEED + 1}" in str(
        refused.value
    )
    assert "allow_new_data_seed=True" in str(refused.value)
    assert run(SHUFFLE_SEED + 1, allow_new_data_seed=True).restored_from == {"epoch": 1, "step": 6}


def test_a_snapshot_copies_every_byte_of_large_tensors_and_of_views_into_the_buffers_before():
    # 40 MiB: three pieces of the threaded byte copy; a transposed view, a conjugate view and bfloat16 besides.
    big = torch.randn(10 * 2**20)
    complex_values = torch.randn(6, dtype=torch.complex64)
    live = {
        "big": big,
        "t": torch.randn(5, 7).t(),
        "conj": complex_values.conj(),
        "bf16": torch.randn(33).bfloat16(),
        "p": torch.nn.Parameter(torch.randn(4)),
    }
    first = snapshot(live)
    for value in (big, live["t"], live["bf16"], live["p"].data):
        value.mul_(-2).add_(1)
    second = snapshot(live, first)
    assert second["big"] is first["big"] and second["t"] is first["t"] and second["conj"] is first["conj"]
    for key, value in live.items():
        assert torch.equal(second[key], value.detach().resolve_conj()), key
    assert torch.equal(second["conj"], complex_values.conj().resolve_conj())
