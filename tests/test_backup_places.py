"""Backup directories that cannot hold backups are refused before the first step, and a save that fails says
where and why and leaves the backups already on disk as they were."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_registry
from workers.fit_resume import BATCH_SIZE, SHUFFLE_SEED, build_model, data

import stratagem as sg
from stratagem import environ
from stratagem.train import checkpoint as checkpoint_module
from stratagem.train.backup import directory as backup_dir_module
from stratagem.train.backup.directory import check_backup_directory
from stratagem.train.checkpoint import load_checkpoint, save_checkpoint

SRC = str(Path(__file__).resolve().parent.parent / "src")
WORKER = str(Path(__file__).resolve().parent / "workers" / "fit_resume.py")


def _fit(backup: sg.callbacks.BackupAndRestore) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model, optimizer = build_model(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = data()
    sg.fit(
        sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1)),
        model,
        optimizer,
        F.cross_entropy,
        (x, y),
        batch_size=BATCH_SIZE,
        seed=SHUFFLE_SEED,
        epochs=1,
        callbacks=[backup],
    )
    return model, before


def test_a_backup_dir_below_a_file_is_refused_by_fit_before_any_step(tmp_path):
    (tmp_path / "a-file").write_text("x")
    backup = sg.callbacks.BackupAndRestore(tmp_path / "a-file" / "backup")  # the constructor cannot tell yet
    model, optimizer = build_model(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(sg.InputError, match=r"backup_dir cannot be created: '.*a-file' on its path is a file"):
        x, y = data()
        sg.fit(sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1)), model, optimizer, F.cross_entropy, (x, y),
               batch_size=BATCH_SIZE, callbacks=[backup])  # fmt: skip
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key  # not one step was taken


def test_a_backup_dir_that_became_a_file_after_construction_is_refused(tmp_path):
    backup = sg.callbacks.BackupAndRestore(tmp_path / "backup")
    (tmp_path / "backup").write_text("x")
    with pytest.raises(sg.InputError, match=r"backup_dir must be a directory. Received: backup_dir='.*backup', which"):
        _fit(backup)


@pytest.mark.timeout(300)
def test_a_read_only_backup_dir_is_refused_naming_the_cause():
    # Root ignores mode bits: the check runs in a child process that drops to an unprivileged user first, in a
    # directory that user can reach (pytest's tmp_path sits below a directory only its owner may enter).
    top = Path(tempfile.mkdtemp(prefix="stratagem-read-only-"))
    top.chmod(0o755)
    locked = top / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        _check_read_only(locked)
    finally:
        locked.chmod(0o755)
        shutil.rmtree(top)


def _check_read_only(locked: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {SRC!r})
        from stratagem.train.backup.directory import check_backup_directory
        if os.geteuid() == 0:  # after the imports: the interpreter's own files may be root's alone
            os.setgid(65534); os.setuid(65534)
        try:
            check_backup_directory({str(locked / "backup")!r})
        except Exception as error:
            print(type(error).__name__, error)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=280, check=False)
    assert result.returncode == 0, result.stderr
    assert "InputError backup_dir cannot hold backups: creating" in result.stdout, result.stdout + result.stderr
    assert "(Permission denied). Received: backup_dir=" in result.stdout


def test_the_write_check_leaves_no_directory_or_file_behind(tmp_path):
    check_backup_directory(tmp_path / "new" / "backup")
    assert list(tmp_path.iterdir()) == []


def test_a_file_system_without_room_for_three_backups_is_refused_at_the_start(tmp_path, monkeypatch):
    model, _ = build_model(False)
    # The backup's tensors: the float64 parameters, and twice as much again for the momentum the optimizer adds at
    # its first step (counted as two tensors per parameter while its state is empty); the metric sums are tiny.
    parameters = sum(p.numel() for p in model.parameters()) * 8
    free = 2 * parameters  # less than three backups of at least 3 * parameters each

    class Usage:
        def __init__(self, free: int) -> None:
            self.free = free

    monkeypatch.setattr(backup_dir_module.shutil, "disk_usage", lambda path: Usage(free))
    with pytest.raises(sg.InputError, match=r"backup_dir has too little free space: its backups need about") as info:
        _fit(sg.callbacks.BackupAndRestore(tmp_path / "backup"))
    assert f"and {free / 2**20:.1f} MB is free" in str(info.value)
    assert "pass keep_previous=False (two files instead of three)" in str(info.value)
    assert not (tmp_path / "backup" / "backup.pt").exists()


def test_a_save_refused_for_lack_of_space_names_the_sizes_and_keeps_both_backups(tmp_path, monkeypatch):
    path, previous = tmp_path / "backup.pt", tmp_path / "backup.previous.pt"
    save_checkpoint(path, {"w": torch.ones(4)}, previous=previous)
    save_checkpoint(path, {"w": torch.full((4,), 2.0)}, previous=previous)

    class Usage:
        free = 1000

    monkeypatch.setattr(checkpoint_module.shutil, "disk_usage", lambda directory: Usage())
    with pytest.raises(sg.CheckpointWriteError) as info:
        save_checkpoint(path, {"w": torch.zeros(262144)}, previous=previous)  # 1 MB of float32
    assert str(info.value).startswith(f"Cannot write the checkpoint {str(path)!r}: the file system is full. It needs ")
    assert "about 1.0 MB and 1000 bytes is free" in str(info.value)
    assert torch.equal(load_checkpoint(path)["w"], torch.full((4,), 2.0))
    assert torch.equal(load_checkpoint(previous)["w"], torch.ones(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["backup.previous.pt", "backup.pt"]


@pytest.mark.timeout(300)
def test_a_save_past_the_file_size_limit_says_so_and_keeps_both_backups(tmp_path):
    # A real failed write: a child process whose files may not exceed 64 KB (SIGXFSZ ignored, so write() fails).
    script = textwrap.dedent(
        f"""
        import resource, signal, sys
        sys.path.insert(0, {SRC!r})
        import torch
        from stratagem.train.checkpoint import save_checkpoint
        path, previous = {str(tmp_path / "backup.pt")!r}, {str(tmp_path / "backup.previous.pt")!r}
        save_checkpoint(path, {{"w": torch.ones(4)}}, previous=previous)
        save_checkpoint(path, {{"w": torch.full((4,), 2.0)}}, previous=previous)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
        try:
            save_checkpoint(path, {{"w": torch.zeros(262144)}}, previous=previous)
        except Exception as error:
            print(type(error).__name__, error)
        """
    )
    env = dict(environ.current())
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=280, check=False, env=env
    )
    assert result.returncode == 0, result.stderr
    path = tmp_path / "backup.pt"
    assert result.stdout.startswith(
        f"CheckpointWriteError Cannot write the checkpoint {str(path)!r}: the file-size limit of this process "
        "(ulimit -f) is 64.0 KB, and it needs about 1.0 MB"
    ), result.stdout + result.stderr
    assert torch.equal(load_checkpoint(path)["w"], torch.full((4,), 2.0))
    assert torch.equal(load_checkpoint(tmp_path / "backup.previous.pt")["w"], torch.ones(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["backup.previous.pt", "backup.pt"]


def test_a_write_that_fails_midway_leaves_the_newest_and_previous_backups_whole(tmp_path, monkeypatch):
    path, previous = tmp_path / "backup.pt", tmp_path / "backup.previous.pt"
    save_checkpoint(path, {"w": torch.ones(4)}, previous=previous)
    save_checkpoint(path, {"w": torch.full((4,), 2.0)}, previous=previous)

    def torn_save(payload, handle):
        handle.write(b"PK\x03\x04 half an archive")
        raise OSError(28, os.strerror(28))  # ENOSPC, as a full disk reports it

    monkeypatch.setattr(checkpoint_module.torch, "save", torn_save)
    with pytest.raises(sg.CheckpointWriteError, match=r"the file system is full: it needs about 1.0 MB and "):
        save_checkpoint(path, {"w": torch.zeros(262144)}, previous=previous)
    monkeypatch.undo()
    # The previous backup was not removed before the new one was in place, and no temporary is left.
    assert torch.equal(load_checkpoint(path)["w"], torch.full((4,), 2.0))
    assert torch.equal(load_checkpoint(previous)["w"], torch.ones(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["backup.previous.pt", "backup.pt"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_bad_backup_dir_stops_a_launched_job_before_its_first_step(tmp_path):
    (tmp_path / "a-file").write_text("x")
    env = dict(environ.current())
    env.update(
        {
            "FIT_STRATEGY": "multi_worker",
            "FIT_BACKUP": str(tmp_path / "a-file" / "backup"),
            "FIT_OUT": str(tmp_path / "out.pt"),
            "FIT_KILL_AFTER": "1",  # would SIGKILL the chief after its first step: it must never get there
        }
    )
    command = [sys.executable, "-m", "stratagem", "launch", "--workers", "2", WORKER]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]
    assert "backup_dir cannot be created: " in output and "a-file' on its path is a file" in output, output[-4000:]
    assert "SIGKILL" not in output and not (tmp_path / "out.pt").exists()
