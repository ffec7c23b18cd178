"""BackupAndRestore on a real cluster's terms: one job per backup directory, and a stop on SIGTERM or Ctrl-C
that backs up at a step boundary every worker agrees on and resumes bit-identically.

Each test runs tests/workers/fit_resume.py as real processes (alone, or as 2 workers under `stratagem launch`)
and compares the final parameters with an uninterrupted run of the same script (torch.equal: bit for bit) and
with a plain one-device loop (test_backup_restore.reference_state)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_backup_restore import assert_matches, reference_state

from stratagem import environ
from stratagem.train.checkpoint import load_checkpoint
from stratagem.train.preemption import StopSignals

WORKER = str(Path(__file__).parent / "workers" / "fit_resume.py")
# 4 steps per epoch, 8 in all; backups every 3 steps. The run pauses after step 4 until it is signalled, so the
# signal comes mid-run and the stop falls after step 5 (epoch 2, batch 1), which no save_freq backup holds.
SAVE_FREQ, PAUSE_AT, STOP_AFTER = 3, 4, 5


def _env(tmp_path: Path, kind: str, out: str = "out.pt", **settings: object) -> dict[str, str]:
    env = dict(environ.current())
    env.update(
        {
            "FIT_STRATEGY": kind,
            "FIT_BACKUP": str(tmp_path / "backup"),
            "FIT_OUT": str(tmp_path / out),
            "FIT_SAVE_FREQ": str(SAVE_FREQ),
            "FIT_MARKER": str(tmp_path / "paused"),
        }
    )
    env.update({k: str(v) for k, v in settings.items()})
    return env


def _start(command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    # SIGINT back to its default in the child: a test run in a shell's background inherits it ignored, and a
    # process that ignores SIGINT keeps ignoring it under BackupAndRestore.
    return subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _wait_for(path: Path, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            raise AssertionError(f"exited with {process.returncode} before pausing:\n{_output(process)}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"did not pause within {timeout} s:\n{_output(process)}")
        time.sleep(0.05)


def _output(process: subprocess.Popen[bytes]) -> str:
    assert process.stdout is not None
    return process.stdout.read().decode(errors="replace")[-4000:]


def _finish(process: subprocess.Popen[bytes], timeout: float) -> tuple[int, str]:
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        raise AssertionError("did not exit in time:\n" + output.decode(errors="replace")[-4000:]) from None
    return process.returncode, output.decode(errors="replace")[-4000:]


def _run(env: dict[str, str], timeout: float = 240) -> tuple[int, str]:
    return _finish(_start([sys.executable, WORKER], env), timeout)


def _assert_bit_identical(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), f"{key} differs by {(got[key] - expected[key]).abs().max()}"


@pytest.fixture(scope="module")
def uninterrupted_one_device(tmp_path_factory) -> dict[str, torch.Tensor]:
    directory = tmp_path_factory.mktemp("uninterrupted")
    code, output = _run(_env(directory, "one_device"))
    assert code == 0, output
    return torch.load(directory / "out.pt")["state"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signalled_run_backs_up_exits_with_its_code_and_resumes_bit_identically(
    tmp_path, signum, uninterrupted_one_device
):
    first = _start([sys.executable, WORKER], _env(tmp_path, "one_device", FIT_PAUSE_AT=PAUSE_AT))
    _wait_for(tmp_path / "paused", first, timeout=240)
    sent = time.monotonic()
    first.send_signal(signum)
    code, output = _finish(first, timeout=30)
    seconds = time.monotonic() - sent
    assert code == 128 + signum, output
    assert f"preempted: Stopped by {signal.Signals(signum).name} after step {STOP_AFTER} " in output, output
    assert seconds < 25, f"{seconds:.2f} s from the signal to the exit"  # well inside the grace period
    assert (tmp_path / "backup" / "backup.pt").is_file() and not (tmp_path / "out.pt").exists()

    code, output = _run(_env(tmp_path, "one_device"))
    assert code == 0, output
    saved = torch.load(tmp_path / "out.pt")
    assert saved["restored_from"] == {"epoch": 1, "step": STOP_AFTER}  # no step lost
    _assert_bit_identical(saved["state"], uninterrupted_one_device)
    assert_matches(saved["state"], reference_state())
    assert not (tmp_path / "backup").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_stratagem_launch_forwards_sigterm_and_both_workers_stop_after_the_same_step(tmp_path):
    launch = [sys.executable, "-m", "stratagem", "launch", "--workers", "2", "--grace-period", "30", WORKER]
    code, output = _finish(_start(launch, _env(tmp_path, "multi_worker", out="uninterrupted.pt")), timeout=300)
    assert code == 0, output
    job = _start(launch, _env(tmp_path, "multi_worker", FIT_PAUSE_AT=PAUSE_AT))
    _wait_for(tmp_path / "paused", job, timeout=300)
    sent = time.monotonic()
    job.send_signal(signal.SIGTERM)
    code, output = _finish(job, timeout=60)
    seconds = time.monotonic() - sent
    assert code == 128 + signal.SIGTERM, output
    for rank in (0, 1):  # the chief was signalled mid-pause, worker 1 inside the next step's sum: same boundary
        assert f"rank {rank} preempted: Stopped by SIGTERM after step {STOP_AFTER} " in output, output
    assert seconds < 30, f"{seconds:.2f} s from the signal to the exit"

    code, output = _finish(_start(launch, _env(tmp_path, "multi_worker")), timeout=300)
    assert code == 0, output
    saved = torch.load(tmp_path / "out.pt")
    assert saved["restored_from"] == {"epoch": 1, "step": STOP_AFTER}
    _assert_bit_identical(saved["state"], torch.load(tmp_path / "uninterrupted.pt")["state"])
    assert_matches(saved["state"], reference_state())


@pytest.mark.timeout(600)
def test_a_second_job_on_a_live_jobs_directory_is_refused_and_a_dead_owner_is_taken_over(tmp_path):
    owner = _start([sys.executable, WORKER], _env(tmp_path, "one_device", FIT_PAUSE_AT=PAUSE_AT))
    _wait_for(tmp_path / "paused", owner, timeout=240)
    # A temporary as the live job's save in progress would leave it: the second job must not touch it.
    half_written = tmp_path / "backup" / ".stratagem-partial.backup.pt.0123456789abcdef.tmp"
    half_written.write_bytes(b"half")
    try:
        code, output = _run(_env(tmp_path, "one_device"))
        assert code == 1, output
        assert "BackupDirectoryInUseError" in output, output
        assert f"belongs to another job: pid {owner.pid} on host" in output, output
        assert half_written.exists()
        assert owner.poll() is None  # the live job goes on
    finally:
        owner.kill()  # SIGKILL: it leaves its claim file behind, but not its lock
        owner.wait()
    assert (tmp_path / "backup" / ".stratagem-claim").exists()

    code, output = _run(_env(tmp_path, "one_device"))
    assert code == 0, output
    assert f"Took over the backup directory {tmp_path / 'backup'} from pid {owner.pid} on host" in output, output
    saved = torch.load(tmp_path / "out.pt")
    assert saved["restored_from"] == {"epoch": 0, "step": SAVE_FREQ}  # the dead job's last backup
    assert_matches(saved["state"], reference_state())
    assert not (tmp_path / "backup").exists()  # its claim, the dead job's temporary and the backups are gone


@pytest.mark.timeout(600)
def test_a_stop_that_outlasts_the_grace_period_exits_with_the_signals_code_and_keeps_the_backups(tmp_path):
    process = _start([sys.executable, WORKER], _env(tmp_path, "one_device", FIT_PAUSE_AT=PAUSE_AT, FIT_GRACE=1,
                                                      FIT_STUCK=120))  # fmt: skip
    _wait_for(tmp_path / "paused", process, timeout=240)
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code, output = _finish(process, timeout=60)
    assert code == 128 + signal.SIGTERM, output
    assert time.monotonic() - sent < 60  # not the 120 s the step is stuck for
    assert "The grace period of 1 s after SIGTERM ran out before the stop finished" in output, output
    assert "preempted" not in output
    # The last backup before the signal (step 3) is whole; the stop's own was never begun.
    assert load_checkpoint(tmp_path / "backup" / "backup.pt")["step"] == SAVE_FREQ


@pytest.fixture
def python_sigint_handler():
    # A test run started in the background of a shell inherits SIGINT ignored; these tests need Python's own.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_second_signal_goes_to_the_handler_installed_before(python_sigint_handler):
    signals = StopSignals(grace_period=60)
    assert signals.install()
    try:
        signal.raise_signal(signal.SIGINT)
        assert signals.requested == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # Python's own SIGINT handler raises KeyboardInterrupt
    finally:
        signals.acted_on()
        signals.uninstall()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_that_no_step_boundary_saw_is_delivered_when_training_ends(python_sigint_handler):
    signals = StopSignals(grace_period=60)
    assert signals.install()
    signal.raise_signal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        signals.uninstall()  # fit ended (or failed) before acting on it: the signal is not swallowed
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_the_process_ignores_stays_ignored(python_sigint_handler):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as nohup or a shell's background job leaves it
    signals = StopSignals(grace_period=60)
    assert signals.install()
    try:
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == signals._handle
        signal.raise_signal(signal.SIGINT)
        assert signals.requested == 0
    finally:
        signals.uninstall()
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
