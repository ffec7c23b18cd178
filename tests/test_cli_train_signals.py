"""``stratagem train --backup-dir`` and SIGTERM, as a scheduler sends it: the command backs up, exits 143 (not 1),
says the stop once, and a rerun resumes with this run's throughput; started as several processes, it passes the
signal to every task, waits for their backup and says where it is.

Real processes: the command is signalled once its first backup is on disk (after epoch 1, so mid-run).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stratagem import environ

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

TRAIN_EXAMPLES, BATCH = 1437, 16  # the digits training split; a small global batch, so an epoch is 90 steps
# The signal is sent once the first backup is written (after epoch 1). The epochs after it must outlast the time the
# signal takes to reach the workers (the test's and the launcher's polling, 0.05 + 0.1 s): at the default batch of 256
# an epoch is 6 steps, and two of them sometimes ended, with the backups removed, before the signal came.
EPOCHS = 3
EPOCHS_MULTI_WORKER = 20  # a stop that works ends the run after the step under way: the run is not longer for it


def _start(args: list[str]) -> subprocess.Popen[str]:
    # SIGINT back to its default in the child: a test run in a shell's background inherits it ignored.
    return subprocess.Popen(
        [sys.executable, "-m", "stratagem", "train", *args],
        env=dict(environ.current()),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _signal_after_first_backup(process: subprocess.Popen[str], backup: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (backup / "backup.pt").exists():
        if process.poll() is not None:
            raise AssertionError(f"exited with {process.returncode} before its first backup:\n{_finish(process, 10)}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"no backup within {timeout} s:\n{_finish(process, 10)}")
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)


def _finish(process: subprocess.Popen[str], timeout: float) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"did not exit within {timeout} s:\n{out[-3000:]}\n{err[-3000:]}") from None
    return process.returncode, out, err


def _inspect(backup: Path) -> list[dict]:
    result = subprocess.run(
        [sys.executable, "-m", "stratagem", "checkpoint", "inspect", str(backup), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["files"]


def _trained_before(entry: dict) -> int:
    """Examples a backup's run trained on: its whole epochs, then full batches of the epoch under way."""
    return (entry["epoch"] - 1) * TRAIN_EXAMPLES + entry["step_in_epoch"] * BATCH


def test_sigterm_backs_up_exits_143_says_it_once_and_a_fallback_resume_names_its_file_and_counts_this_run(tmp_path):
    backup = tmp_path / "backup"
    command = [
        "--strategy",
        "one_device",
        "--epochs",
        str(EPOCHS),
        "--batch-size",
        str(BATCH),
        "--backup-dir",
        str(backup),
    ]
    job = _start(command)
    _signal_after_first_backup(job, backup, timeout=180)
    code, out, err = _finish(job, timeout=120)
    assert code == 143, (code, out[-2000:], err[-2000:])
    assert "training failed" not in err
    assert len(re.findall(r"Stopped by SIGTERM after step \d+", out + err)) == 1, err
    assert f"backed up to {backup / 'backup.pt'}" in err

    # The newest backup damaged: the rerun falls back to the previous one, and says that is the file it read.
    newest, previous = _inspect(backup)
    assert (newest["name"], previous["name"]) == ("backup.pt", "backup.previous.pt")
    raw = bytearray((backup / "backup.pt").read_bytes())
    raw[raw.index(b"data/0") + 200] ^= 0x01  # inside the first tensor's bytes
    (backup / "backup.pt").write_bytes(bytes(raw))
    code, out, err = _finish(_start([*command, "--json"]), timeout=300)
    assert code == 0, err[-3000:]
    assert f"Resumed from {backup / 'backup.previous.pt'}: epoch {previous['epoch']} of {EPOCHS}" in err

    # This run's examples and time, not the first run's as well: their sum is the whole training.
    report = json.loads(out)
    resumed = _trained_before(previous)
    assert resumed > 0
    assert report["num_resumed_examples"] == resumed
    assert report["num_train_examples"] == EPOCHS * TRAIN_EXAMPLES - resumed
    assert 0 < report["train_time_s"] <= report["elapsed_s"]
    assert report["samples_per_s"] == pytest.approx(report["num_train_examples"] / report["train_time_s"])


def test_sigterm_to_a_multi_worker_train_reaches_every_worker_and_names_the_backup(tmp_path):
    backup = tmp_path / "backup"
    job = _start(
        [
            *("--strategy", "multi_worker", "--workers", "2", "--epochs", str(EPOCHS_MULTI_WORKER)),
            *("--batch-size", str(BATCH), "--backup-dir", str(backup)),
        ]
    )
    _signal_after_first_backup(job, backup, timeout=300)
    code, out, err = _finish(job, timeout=120)
    # Before: the command died of the signal at once (-15), silent, and its orphaned workers wrote a backup later.
    assert code == 143, (code, out[-2000:], err[-2000:])
    assert "[worker:0] WARNING stratagem.train.fit: Stopped by SIGTERM" in err
    assert "[worker:1] WARNING stratagem.train.fit: Stopped by SIGTERM" in err
    said = re.search(
        r"^stratagem train: received SIGTERM; stopped every task \(exit code 143\)\. The backup is (\S+) "
        r"\(step (\d+), epoch (\d+)\): rerun the same command to resume from it\.$",
        err,
        re.MULTILINE,
    )
    assert said is not None, err[-3000:]
    newest = _inspect(backup)[0]
    assert (said[1], int(said[2]), int(said[3])) == (str(backup / "backup.pt"), newest["step"], newest["epoch"])
    # Both workers stopped after the same step, the one the backup holds.
    steps = set(re.findall(r"\[worker:\d\] WARNING stratagem\.train\.fit: Stopped by SIGTERM after step (\d+)", err))
    assert steps == {str(newest["step"])}


def test_a_stop_with_no_backup_left_names_both_reasons_and_does_not_claim_it_came_first(tmp_path):
    # A signal in the moments between training's end (which removes the backups) and the exit leaves none: the
    # message said "the stop came before the first one", which was untrue then.
    from stratagem.cli.launch import stop_message
    from stratagem.cluster.attempt import StopRequest
    from stratagem.cluster.launch import LaunchResult

    stop = StopRequest()
    stop.request(signal.SIGTERM, None)
    result = LaunchResult(exit_code=143, failed_task=None, reason=None, restarts=0)
    said = stop_message(stop, result, str(tmp_path / "backup"))
    assert "or after training had finished and removed them" in said, said
    assert said.endswith("A rerun starts afresh."), said
