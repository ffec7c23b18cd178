"""Backups are verified before a run resumes from them: a byte flipped in a tensor's data is refused with
the file named and the run resumes from the previous backup; clean-up removes only what BackupAndRestore
wrote; a backup that does not fit names its file and says what to do."""

from __future__ import annotations

import logging
import struct
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_registry
from test_backup_restore import assert_matches, reference_state
from workers.fit_resume import BATCH_SIZE, EPOCHS, SHUFFLE_SEED, build_model, data

import stratagem as sg
from stratagem.train import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.timeout(60)


class FailAtStep(sg.callbacks.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, context, num_examples):
        if context.step == self.step:
            raise RuntimeError(f"failure at step {self.step}")


def fit(backup: sg.callbacks.BackupAndRestore, *callbacks: sg.callbacks.Callback, model=None):
    net, optimizer = build_model(False) if model is None else (model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data()
    return sg.fit(
        sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1)),
        net,
        optimizer,
        F.cross_entropy,
        (x, y),
        batch_size=BATCH_SIZE,
        seed=SHUFFLE_SEED,
        epochs=EPOCHS,
        clip_grad_norm=1.0,
        callbacks=[backup, *callbacks],
    )


def interrupted_run(directory: Path, **settings) -> sg.callbacks.BackupAndRestore:
    """A run backed up after every step that fails at step 3: backups of steps 2 (and 1, the previous) stay."""
    backup = sg.callbacks.BackupAndRestore(directory, save_freq=1, **settings)
    with pytest.raises(RuntimeError, match="failure at step 3"):
        fit(backup, FailAtStep(3))
    return backup


def flip_a_byte_in_tensor_data(path: Path) -> str:
    """Flips one bit in the middle of the stored bytes of the model's first parameter; returns the member's name."""
    first = next(iter(torch.load(path, weights_only=True)["model"].values()))
    with zipfile.ZipFile(path) as archive:
        member = next(m for m in archive.infolist() if archive.read(m) == first.numpy().tobytes())
    with open(path, "r+b") as handle:
        handle.seek(member.header_offset)
        header = handle.read(30)  # the local file header: name and extra-field lengths at bytes 26-29
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        position = member.header_offset + 30 + name_length + extra_length + member.file_size // 2
        handle.seek(position)
        byte = handle.read(1)[0]
        handle.seek(position)
        handle.write(bytes([byte ^ 0x10]))
    return member.filename


def test_a_flipped_byte_in_a_tensor_is_refused_and_the_run_resumes_from_the_previous_backup(tmp_path, caplog):
    backup = interrupted_run(tmp_path / "b")
    assert load_checkpoint(backup.path)["step"] == 2 and load_checkpoint(backup.previous_path)["step"] == 1
    before = torch.load(backup.path, weights_only=True)
    member = flip_a_byte_in_tensor_data(backup.path)
    after = torch.load(backup.path, weights_only=True)  # torch itself reads the damaged file without a word
    first = next(iter(before["model"]))
    assert not torch.equal(before["model"][first], after["model"][first])

    resumed = sg.callbacks.BackupAndRestore(tmp_path / "b", save_freq=1)
    with caplog.at_level(logging.WARNING, logger="stratagem.train.backup.callback"):
        history = fit(resumed)
    assert resumed.restored_from == {"epoch": 0, "step": 1}
    assert resumed.restored_path == resumed.previous_path
    warned = " ".join(record.getMessage() for record in caplog.records)
    assert (
        f"{str(resumed.path)!r} is not a readable checkpoint: it is damaged (Bad CRC-32 for file '{member}')" in warned
    )
    assert f"Resuming from the previous backup {resumed.previous_path}" in warned
    assert_matches(history.model.state_dict(), reference_state())  # nothing of the damaged backup was used
    # The damaged file is kept aside for inspection, so the directory stays; the backups themselves are gone.
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [".stratagem-backup-dir", "backup.corrupt.pt"]


def test_a_damaged_backup_with_no_previous_one_is_refused_with_its_name(tmp_path):
    backup = interrupted_run(tmp_path / "b", keep_previous=False)
    assert not backup.previous_path.exists()  # one backup on disk, as asked
    member = flip_a_byte_in_tensor_data(backup.path)
    with pytest.raises(
        sg.CorruptCheckpointError,
        match=rf"'{backup.path}' is not a readable checkpoint: it is damaged \(Bad CRC-32 for file "
        rf"'{member}'\).* No whole backup is left to resume from \(and there is no previous backup",
    ):
        fit(sg.callbacks.BackupAndRestore(tmp_path / "b"))
    assert backup.path.exists()  # refused, not deleted


def test_both_backups_damaged_are_refused_naming_both(tmp_path):
    backup = interrupted_run(tmp_path / "b")
    flip_a_byte_in_tensor_data(backup.path)
    flip_a_byte_in_tensor_data(backup.previous_path)
    with pytest.raises(
        sg.CorruptCheckpointError,
        match=rf"(?s)'{backup.path}' is not a readable.*"
        rf"'{backup.previous_path}' is not a readable.*No whole backup",
    ):
        fit(sg.callbacks.BackupAndRestore(tmp_path / "b"))


def test_a_run_killed_between_the_two_renames_of_a_save_resumes_from_the_previous_backup(tmp_path, caplog):
    backup = interrupted_run(tmp_path / "b")
    backup.path.unlink()  # what a kill after "backup.pt -> backup.previous.pt" and before "temporary -> backup.pt" leaves
    resumed = sg.callbacks.BackupAndRestore(tmp_path / "b", save_freq=1)
    with caplog.at_level(logging.WARNING):
        history = fit(resumed)
    assert resumed.restored_from == {"epoch": 0, "step": 1} and not caplog.records
    assert_matches(history.model.state_dict(), reference_state())
    assert not (tmp_path / "b").exists()


def test_a_truncated_backup_is_refused(tmp_path):
    path = save_checkpoint(tmp_path / "state.pt", {"weights": torch.ones(1000)})
    path.write_bytes(path.read_bytes()[:-200])  # the archive's directory at the end is cut off
    with pytest.raises(
        sg.CorruptCheckpointError, match=r"state.pt' is not a readable checkpoint: it is not a zip archive"
    ):
        load_checkpoint(path)


# ---- clean-up: only what BackupAndRestore wrote ---------------------------------------------------


def test_clean_up_removes_only_its_own_temporaries_and_never_a_directory_it_did_not_create(tmp_path):
    mine = tmp_path / "user_dir"
    mine.mkdir()
    user_files = [".notes.tmp", ".backup.pt.abcd1234.tmp", ".stratagem-partial.backup.pt.mine.tmp"]
    for name in user_files:
        (mine / name).write_text("the user's")
    stale = mine / ".stratagem-partial.backup.pt.0123456789abcdef.tmp"  # a save killed midway
    stale.write_bytes(b"half a backup")
    fit(sg.callbacks.BackupAndRestore(mine, save_freq=2))
    assert sorted(p.name for p in mine.iterdir()) == sorted(user_files)

    empty = tmp_path / "empty_user_dir"
    empty.mkdir()
    fit(sg.callbacks.BackupAndRestore(empty, save_freq=2))
    assert empty.is_dir() and not any(empty.iterdir())  # the user made it: it stays, empty as it was

    made = tmp_path / "parent" / "made_here"
    fit(sg.callbacks.BackupAndRestore(made, save_freq=2))
    assert not made.exists() and (tmp_path / "parent").is_dir()  # only the directory it created goes


# ---- errors that name the backup and say what to do ----------------------------------------------


def test_a_backup_missing_fields_names_the_file_and_the_fields(tmp_path):
    backup = interrupted_run(tmp_path / "b")
    state = load_checkpoint(backup.path)
    del state["metric_names"], state["format"], state["version"]
    save_checkpoint(backup.path, state)
    with pytest.raises(
        sg.InputError,
        match=rf"Cannot resume from the backup '{backup.path}': The backup lacks fields "
        r"that fit writes: \['metric_names'\].*remove it to start afresh",
    ):
        fit(sg.callbacks.BackupAndRestore(tmp_path / "b"))


def test_a_backup_of_another_model_names_the_file(tmp_path):
    interrupted_run(tmp_path / "b")
    with pytest.raises(
        sg.InputError,
        match=rf"(?s)Cannot resume from the backup '{tmp_path / 'b' / 'backup.pt'}': The "
        r"backup does not fit this model or optimizer.*Build the same model",
    ):
        fit(sg.callbacks.BackupAndRestore(tmp_path / "b"), model=torch.nn.Linear(6, 4, dtype=torch.float64))


class Foreign:
    """An object torch.load(weights_only=True) refuses to unpickle."""


def test_a_file_with_foreign_objects_is_refused_without_advice_to_turn_the_check_off(tmp_path):
    torch.save({"format": "stratagem-checkpoint", "object": Foreign()}, tmp_path / "foreign.pt")
    with pytest.raises(
        sg.InputError,
        match=r"foreign.pt' holds objects other than tensors and plain containers "
        r"\(Unsupported global: .*Foreign.*\).*never unpickles",
    ) as caught:
        load_checkpoint(tmp_path / "foreign.pt")
    assert "weights_only=False" not in str(caught.value) and not isinstance(caught.value, sg.CorruptCheckpointError)
