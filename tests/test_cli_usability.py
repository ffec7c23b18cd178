"""The commands' first hour: refusals before any work in command-line spelling, one-line errors for
files the system refuses, resumed runs that say so, and a tidy Ctrl-C."""

from __future__ import annotations

import argparse
import importlib.util
import signal
import subprocess
import sys

import pytest

from stratagem.cli import train as train_cli
from stratagem.cli.main import main
from stratagem.demo import job

pytestmark = pytest.mark.timeout(120)


def err_of(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def no_work(monkeypatch):
    """Makes any training or relaunch fail the test: the refusals must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(train_cli, "train_digits", refuse)
    monkeypatch.setattr(train_cli, "relaunch", refuse)
    monkeypatch.setattr(train_cli, "build_strategy", refuse)


def test_parameter_server_with_a_backup_dir_is_refused_before_training(capsys, monkeypatch, tmp_path):
    no_work(monkeypatch)
    code, err = err_of(
        capsys, "train", "--strategy", "parameter_server", "--workers", "2", "--backup-dir", str(tmp_path / "b")
    )
    assert code == 2
    assert "--backup-dir does not work with --strategy parameter_server" in err and "--strategy multi_worker" in err


@pytest.mark.parametrize("path", ["/proc/nope", "/sys/kernel/nope"])
def test_an_unwritable_backup_dir_is_found_before_any_work(capsys, monkeypatch, path):
    no_work(monkeypatch)
    code, err = err_of(capsys, "train", "--backup-dir", path)
    assert code == 2
    assert err.startswith(f"stratagem train: --backup-dir: cannot write into {path} (") and err.count("\n") == 1


def test_a_writable_backup_dir_is_checked_without_leaving_anything(capsys, monkeypatch, tmp_path):
    from stratagem.cli.checks import check_writable_directory

    check_writable_directory(tmp_path / "a" / "b", "--backup-dir")
    assert list(tmp_path.iterdir()) == []


def test_bench_out_that_cannot_be_written_is_refused_before_measuring(capsys, monkeypatch):
    import stratagem.cli.bench as bench_cli

    monkeypatch.setattr(bench_cli, "run_scaling", lambda *a, **k: pytest.fail("measured before checking --out"))
    code, err = err_of(capsys, "bench", "--quick", "--out", "/proc/x")
    assert code == 2 and "stratagem bench: --out: cannot write into /proc/x (" in err and "Traceback" not in err


def test_an_os_error_during_training_is_one_line(capsys, monkeypatch):
    def full_disk(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/data/backup/backup.pt")

    monkeypatch.setattr(train_cli, "train_digits", full_disk)
    code, err = err_of(capsys, "train", "--epochs", "1")
    assert code == 1
    assert err == "stratagem train: training failed: [Errno 13] Permission denied: '/data/backup/backup.pt'\n"


def test_any_os_error_a_command_meets_is_one_line(capsys, monkeypatch):
    def broken(args):
        raise FileNotFoundError(2, "No such file or directory", "/nope")

    import stratagem.cli.devices as devices_cli

    monkeypatch.setattr(devices_cli, "run", broken)
    code, err = err_of(capsys, "devices")
    assert code == 1 and err == "stratagem devices: [Errno 2] No such file or directory: '/nope'\n"


def _keep_backup(monkeypatch, backup_dir):
    """The first run leaves its backup behind, as a run killed after its first epoch would."""
    from stratagem.train import BackupAndRestore

    class KeepBackup(BackupAndRestore):
        def on_train_end(self, context, history):
            pass

    original = job.fit

    def fit_keeping_backup(*args, callbacks=(), **kwargs):
        callbacks = [KeepBackup(backup_dir) if isinstance(c, BackupAndRestore) else c for c in callbacks]
        return original(*args, callbacks=callbacks, **kwargs)

    monkeypatch.setattr(job, "fit", fit_keeping_backup)


def test_a_resumed_run_says_so_and_refuses_changed_settings(capsys, monkeypatch, tmp_path):
    backup = tmp_path / "b"
    common = ["--strategy", "one_device", "--batch-size", "256", "--backup-dir", str(backup)]
    with monkeypatch.context() as patch:
        _keep_backup(patch, backup)
        assert main(["train", "--json", "--epochs", "1", "--lr", "0.003", "--seed", "0", *common]) == 0
    capsys.readouterr()
    code, err = err_of(capsys, "train", "--epochs", "2", "--lr", "0.01", "--seed", "5", *common)
    assert code == 1
    assert f"The backup in {backup} was made with --lr 0.003 --seed 0" in err and "Received: --lr 0.01 --seed 5" in err
    assert (backup / "backup.pt").exists()  # refused, so the backup is still there to resume from
    assert main(["train", "--epochs", "2", "--lr", "0.003", "--seed", "0", *common]) == 0
    out = capsys.readouterr().out  # no -v: the line shows all the same
    assert f"stratagem train: Resumed from {backup / 'backup.pt'}: epoch 2 of 2, after step 6." in out
    assert "--lr 0.003, --seed 0" in out


def test_ctrl_c_in_train_and_train_workers_is_one_line(capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_cli, "train_digits", interrupted)
    code, err = err_of(capsys, "train", "--epochs", "1")
    assert code == 130 and err == "stratagem train: interrupted (Ctrl-C); stopped.\n"
    monkeypatch.setattr(train_cli, "relaunch", interrupted)
    code, err = err_of(capsys, "train", "--strategy", "multi_worker", "--workers", "2")
    assert code == 130 and err == "stratagem train: interrupted (Ctrl-C); stopped.\n"


@pytest.mark.multiprocess
def test_ctrl_c_to_launch_stops_the_tasks_with_one_line(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stratagem",
            "launch",
            "--workers",
            "1",
            "--grace-period",
            "1",
            "--timeout",
            "90",
            str(script),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert launcher.stdout.readline().strip() == "[worker:0] up"
        launcher.send_signal(signal.SIGINT)  # what Ctrl-C sends the launcher (its tasks run in their own sessions)
        out, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 130
    assert err == "stratagem launch: interrupted (Ctrl-C); stopped.\n"


def test_devices_out_of_range_are_refused_in_command_line_spelling(capsys):
    code, err = err_of(capsys, "train", "--devices", "cpu:5")
    assert code == 2
    assert "--devices names cpu:5, which is out of range: this machine has" in err and "e.g. --devices cpu:0" in err
    assert "sg." not in err and "set_logical_device_configuration" not in err


def test_counts_are_refused_with_examples_that_suit_them(capsys):
    for argv, expected in (
        (["train", "--workers", "0"], "Use e.g. 2"),
        (["train", "--ps", "0"], "Use e.g. 1"),
        (["bench", "--replicas", "0"], "replica counts must be positive"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and expected in err and "e.g. 10" not in err and "replicas=(" not in err


def test_ps_without_the_parameter_server_is_refused_as_workers_is(capsys, monkeypatch):
    no_work(monkeypatch)
    code, err = err_of(capsys, "train", "--ps", "2")
    assert code == 2 and "--ps 2 needs --strategy parameter_server. Received: --strategy mirrored" in err


def test_doctor_facts_that_are_missing_or_not_json(capsys, tmp_path):
    code, err = err_of(capsys, "doctor", "--facts", str(tmp_path / "none.json"))
    assert code == 2 and f"--facts: cannot read {tmp_path / 'none.json'} (No such file or directory)" in err
    (tmp_path / "bad.json").write_text("{x")
    code, err = err_of(capsys, "doctor", "--facts", str(tmp_path / "bad.json"))
    assert code == 2 and f"--facts: {tmp_path / 'bad.json'} is not JSON (" in err and "stratagem doctor --json" in err


def test_launch_no_python_with_a_missing_executable(capsys, tmp_path):
    code, err = err_of(capsys, "launch", "--workers", "1", "--no-python", str(tmp_path / "nope"))
    assert code == 2 and "no such executable. Received: --no-python" in err and "Traceback" not in err


def test_help_texts_name_every_action_and_what_workers_takes(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "inspect, verify or export" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["checkpoint", "--help"])
    assert "export" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    workers = " ".join(capsys.readouterr().out.split()).split("--workers WORKERS")[-1].split("--ps", 1)[0]
    # Every strategy --workers starts, from the records: it named three and not tensor_parallel.
    assert "with --strategy multi_worker, parameter_server, sharded or tensor_parallel:" in workers, workers


def test_refusals_of_train_flags_are_in_the_flags_typed(capsys, monkeypatch):
    monkeypatch.setattr(train_cli, "train_digits", lambda *a, **k: pytest.fail("trained after a refusal"))
    code, err = err_of(capsys, "train", "--strategy", "one_device", "--devices", "cpu:0,cpu:1")
    assert code == 2
    assert "--strategy one_device runs on exactly one device. Received: --devices cpu:0,cpu:1." in err
    assert "devices=[" not in err
    code, err = err_of(capsys, "train", "--strategy", "one_device", "--devices", "cpu:0", "--precision", "fp16")
    assert code == 2
    assert "Received: --precision fp16 with replicas on cpu. Use --precision bf16 on the CPU" in err
    assert "precision=" not in err


def test_a_resumed_run_with_another_batch_size_is_refused_in_flags():
    config = job.TrainConfig(batch_size=32)
    backup = train_cli.BackupAndRestore("/nonexistent/backup")
    settings = train_cli.BackupSettings(config, backup, json_output=False)
    with pytest.raises(train_cli.InputError, match=r"was made with --batch-size 64,.* Received: --batch-size 32\."):
        settings.check_state_dict({"lr": config.lr, "seed": config.seed, "batch_size": 64})
    settings.check_state_dict({"lr": config.lr, "seed": config.seed})  # a backup from before batch_size was kept


def test_the_explanation_train_prints_gives_the_real_reason_for_the_devices():
    from stratagem.strategies.by_name import build_strategy, explain_built

    strategy, decision = build_strategy("one_device")
    try:
        devices = explain_built(strategy, decision).decision("devices")
    finally:
        strategy.close()
    assert devices is not None and devices.reason == decision.reason and "devices=" not in devices.reason
    assert "So the CPU.)" not in decision.reason


def test_an_asynchronous_job_is_not_said_to_have_replicas_in_sync():
    from stratagem.diagnose import PlacementDecision
    from stratagem.strategies.explain import Explanation

    updates = PlacementDecision(subject="updates", choice="asynchronous", reason="each ps applies them on arrival")
    text = str(Explanation("ParameterServerStrategy", 1, [], [updates]))
    assert text.splitlines()[0] == "ParameterServerStrategy: asynchronous updates, no replicas in sync"


def test_the_batch_norm_line_is_only_for_a_model_with_batch_norm():
    from conftest import cpu_registry
    from torch import nn

    import stratagem as sg

    for model, shown in ((nn.Linear(3, 2), False), (nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)), True)):
        # per_replica: the same line, without building the native meetings of global statistics (slow, once).
        strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2), batch_norm="per_replica")
        try:
            assert strategy.explain().decision("BatchNorm statistics") is not None  # any layer the model may have
            strategy.distribute(model)
            assert (strategy.explain().decision("BatchNorm statistics") is not None) == shown
        finally:
            strategy.close()


def test_bench_without_matplotlib_says_so_before_measuring(capsys, monkeypatch, tmp_path):
    from stratagem.cli import bench as bench_cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(bench_cli, "run_scaling", lambda *a, **k: pytest.fail("measured before saying so"))
    code, err = err_of(capsys, "bench", "--quick", "--out", str(tmp_path), "--plot", str(tmp_path / "p.png"))
    assert code == 2 and "--plot needs matplotlib" in err and "pip install 'stratagem[bench]'" in err
    args = bench_cli.add_parser(argparse.ArgumentParser().add_subparsers()).parse_args(["--quick"])
    assert bench_cli._check_plotting(args) is False
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no stratagem-bench.png will be drawn" in err and "stratagem[bench]" in err


def test_export_to_safetensors_without_the_package_says_which_extra_before_reading(capsys, monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "safetensors" else real(name, *a))
    code, err = err_of(capsys, "checkpoint", "export", str(tmp_path / "nothing"), str(tmp_path / "m.safetensors"))
    assert code == 2  # the missing package is said first: the backup path is not even looked at
    assert "needs the safetensors package" in err and "pip install 'stratagem[train]'" in err
