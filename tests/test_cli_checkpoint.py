"""``stratagem checkpoint inspect`` and ``verify`` on the backups a real fit wrote (kept with delete_checkpoint=False)."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from conftest import cpu_registry
from workers.fit_resume import BATCH_SIZE, NUM_EXAMPLES, SHUFFLE_SEED, build_model, data

import stratagem as sg
from stratagem.cli.main import main


def _backups(tmp_path):
    model, optimizer = build_model(False)
    x, y = data()
    backup = sg.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=3, delete_checkpoint=False)
    sg.fit(
        sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2)),
        model,
        optimizer,
        F.cross_entropy,
        (x, y),
        batch_size=BATCH_SIZE,
        seed=SHUFFLE_SEED,
        epochs=2,
        callbacks=[backup],
    )
    return tmp_path / "backup", model


def test_inspect_and_verify_report_each_backup_and_a_flipped_byte_fails_verify(tmp_path, capsys):
    directory, model = _backups(tmp_path)
    # 40 examples in batches of 12: 4 steps an epoch; backups after steps 3 and 6 (the newest), none at 8.
    assert main(["checkpoint", "inspect", str(directory), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["owner"] is None and report["temporaries"] == []
    newest, previous = report["files"]
    # Epochs counted from 1 in the JSON as in the text: step 6 is 2 batches into epoch 2.
    assert (newest["name"], newest["step"], newest["epoch"], newest["step_in_epoch"]) == ("backup.pt", 6, 2, 2)
    assert (previous["name"], previous["step"], previous["epoch"]) == ("backup.previous.pt", 3, 1)
    assert newest["strategy"] == "MirroredStrategy"
    assert (newest["num_replicas_in_sync"], newest["num_processes"]) == (2, 1)
    model_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    assert newest["parts"]["model"] == model_bytes
    assert newest["parts"]["optimizer"] == model_bytes  # SGD with momentum: one buffer per parameter
    assert newest["bytes"] == (directory / "backup.pt").stat().st_size
    assert NUM_EXAMPLES == 40

    assert main(["checkpoint", "inspect", str(directory)]) == 0
    text = capsys.readouterr().out
    assert "backup.pt" in text and "step 6, epoch 2 (2 batch(es) into it), MirroredStrategy, 2 replica(s)" in text

    assert main(["checkpoint", "verify", str(directory)]) == 0
    assert "every backup is whole" in capsys.readouterr().out

    raw = bytearray((directory / "backup.previous.pt").read_bytes())
    data_at = raw.index(b"data/0") + 200  # inside the first tensor's bytes
    raw[data_at] ^= 0x01
    (directory / "backup.previous.pt").write_bytes(bytes(raw))
    assert main(["checkpoint", "verify", str(directory)]) == 1
    out = capsys.readouterr().out
    assert "backup.previous.pt" in out and "DAMAGED: The file" in out and "backup.pt  " in out
    assert torch.load(directory / "backup.pt", weights_only=True)["step"] == 6  # the newest untouched


def test_verify_of_a_directory_without_backups_fails_and_inspect_is_a_usage_error(tmp_path, capsys):
    assert main(["checkpoint", "verify", str(tmp_path)]) == 1
    assert "holds no backup (none of backup.pt" in capsys.readouterr().err
    assert main(["checkpoint", "inspect", str(tmp_path / "missing")]) == 2
    assert "No backup directory or checkpoint file at" in capsys.readouterr().err


def test_export_writes_the_plain_model_of_the_newest_backup_as_torch_and_safetensors(tmp_path, capsys):
    from safetensors.torch import load_file

    directory, _ = _backups(tmp_path)
    newest = torch.load(directory / "backup.pt", weights_only=True)["model"]
    plain, _ = build_model(False)  # the model as the user built it: its keys must load as they are
    assert main(["checkpoint", "export", str(directory), str(tmp_path / "model.pt")]) == 0
    assert f"wrote the model of {directory / 'backup.pt'} (step 6, epoch 2)" in capsys.readouterr().out
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, newest[name]), name
    assert main(["checkpoint", "export", str(directory), str(tmp_path / "model.safetensors")]) == 0
    exported = load_file(str(tmp_path / "model.safetensors"))
    assert exported.keys() == newest.keys()
    assert all(torch.equal(exported[name], newest[name]) for name in newest)
    assert main(["checkpoint", "export", str(tmp_path / "nothing"), str(tmp_path / "m.pt")]) == 2
    assert "No backup directory or checkpoint file at" in capsys.readouterr().err


def test_verify_of_a_damaged_zip_directory_says_the_directory_is_damaged(tmp_path, capsys):
    directory, _ = _backups(tmp_path)
    raw = bytearray((directory / "backup.pt").read_bytes())
    # The high byte of the first directory entry's flags: no CRC32 covers the zip directory, so every member's bytes
    # still match their checksums, and torch's reader refuses the archive (it reads the flags as encryption).
    raw[raw.index(b"PK\x01\x02") + 9] ^= 0xFF
    (directory / "backup.pt").write_bytes(bytes(raw))
    assert main(["checkpoint", "verify", str(directory)]) == 1
    out = capsys.readouterr().out
    assert "backup.pt" in out and "its zip directory or a member's header is damaged" in out
    assert "checksums hold but" not in out


def test_export_says_when_a_damaged_newest_backup_makes_it_export_an_older_one(tmp_path, capsys):
    directory, _ = _backups(tmp_path)
    raw = bytearray((directory / "backup.pt").read_bytes())
    raw[raw.index(b"data/0") + 200] ^= 0x01
    (directory / "backup.pt").write_bytes(bytes(raw))
    assert main(["checkpoint", "export", str(directory), str(tmp_path / "model.pt")]) == 0
    captured = capsys.readouterr()
    assert (
        f"stratagem checkpoint export: warning: {directory / 'backup.pt'} is damaged and was passed over; exporting "
        f"{directory / 'backup.previous.pt'} (step 3, epoch 1), an older backup than the newest written."
        in captured.err
    )
    assert f"wrote the model of {directory / 'backup.previous.pt'} (step 3, epoch 1)" in captured.out
