"""The claim on a backup directory where the file system has no locks: the claim file's contents decide alone.

(With locks, two real processes on one directory are in test_backup_preemption.py.)"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys

import pytest

import stratagem as sg
from stratagem.train.backup import claim as backup_claim
from stratagem.train.backup.claim import CLAIM_NAME, DirectoryClaim, read_claim


def _no_locks(fd: int, operation: int) -> None:
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))


def _write_claim(directory, pid: int, host: str | None = None) -> None:
    owner = {
        "host": host or socket.gethostname(),
        "pid": pid,
        "start_ticks": backup_claim._start_ticks(pid),
        "token": "0123456789abcdef",
        "claimed_at": 0.0,
    }
    (directory / CLAIM_NAME).write_text(json.dumps(owner))


def test_without_locks_a_live_owner_on_this_host_keeps_the_claim(tmp_path, monkeypatch):
    monkeypatch.setattr(backup_claim.fcntl, "flock", _no_locks)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_claim(tmp_path, other.pid)
        with pytest.raises(sg.BackupDirectoryInUseError, match=rf"belongs to another job: pid {other.pid} on host"):
            DirectoryClaim.acquire(tmp_path, "job-b")
    finally:
        other.kill()
        other.wait()
    # Gone now: its claim is taken over, and the takeover is recorded.
    claim = DirectoryClaim.acquire(tmp_path, "job-b")
    try:
        assert claim.took_over_from is not None and claim.took_over_from.pid == other.pid
        owner = read_claim(tmp_path)
        assert owner is not None and (owner.pid, owner.token) == (os.getpid(), "job-b")
    finally:
        claim.release()
    assert not (tmp_path / CLAIM_NAME).exists()


def test_without_locks_an_owner_on_another_host_is_not_second_guessed(tmp_path, monkeypatch):
    monkeypatch.setattr(backup_claim.fcntl, "flock", _no_locks)
    _write_claim(tmp_path, 1, host="some-other-host")
    with pytest.raises(
        sg.BackupDirectoryInUseError, match=r"which runs on another host, and this file system has no locks to tell"
    ) as info:
        DirectoryClaim.acquire(tmp_path, "job-b")
    assert f"if that job is surely gone, remove {str(tmp_path / CLAIM_NAME)!r}" in str(info.value)


def test_a_directory_that_cannot_hold_the_claim_file_is_refused_with_the_cause(tmp_path):
    with pytest.raises(sg.InputError, match=r"Cannot claim the backup directory .*: creating .* failed \("):
        DirectoryClaim.acquire(tmp_path / "missing", "job-b")
