"""sg.fit and `stratagem train` drive TensorParallelStrategy: BackupAndRestore backs every rank's parts up and a run
resumes from them, under ShardedStrategy and back, exactly (the tiny GPT-2 of tensor_parallel_cases, float64,
AdamW, clipping), and accumulates as one device does on a model mesh; a backward outside strategy.run, accumulation
on a data axis and a memory plan over the process's limit are refused with the fix."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import tensor_parallel_fit_cases as cases
from helpers import free_port, run_ranks
from test_sharded_memory_limit import make_cgroups, remove_cgroups

from stratagem import environ

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.timeout(400)
def test_fit_backs_up_under_tensor_parallel_and_resumes_under_sharded_and_back_as_one_device_trains(tmp_path):
    ports = [[free_port(), free_port()] for _ in range(3)]
    outcomes = run_ranks(cases.fit_across_techniques, [0, 1], args=(ports, str(tmp_path / "backup")), timeout=360)
    for outcome in outcomes.values():
        assert outcome.error is None, outcome.error
    runs = outcomes[0].value
    # Each run resumed from the step the one before it stopped after, mid-epoch 2: the data position carried over.
    assert runs["tensor parallel"]["restored from"] is None
    assert runs["sharded"]["restored from"] == {"epoch": 1, "step": 4}
    assert runs["tensor parallel again"]["restored from"] == {"epoch": 1, "step": 5}
    # Each run's last step equals one device's same step (on the batches of the documented order, so a data position
    # lost would show).
    for run, steps in (("tensor parallel", 4), ("sharded", 5), ("tensor parallel again", 6)):
        for name, value in cases.fit_one_device(steps).items():
            worst = float(abs(runs[run]["whole"][name] - value.numpy()).max() / value.abs().max())
            assert worst <= 1e-9, f"{run}, step {steps}: {name} {worst:.2e} relative"
    # fit's default trace covered each run, tensor-parallel and sharded: each worker's table of a sample of its
    # steps (the first recorded), each row's parts adding up to it.
    for rank, outcome in outcomes.items():
        for run, got in outcome.value.items():
            trace = got["trace"]
            assert trace is not None and 1 <= trace["num_recorded"] <= trace["num_steps"], (rank, run, trace)
            assert trace["tasks"] == [f"worker:{rank}"] * trace["num_recorded"] and trace["adds_up"], (rank, run)


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, Any], bool]:
    """One run of `cases.on_two_workers` on 2 workers, shared by the tests below: each rank's results, and whether
    the cgroup part ran (it needs root and cgroup v1)."""
    try:
        directories: list[str] | None = make_cgroups()[:2]
    except pytest.skip.Exception:
        directories = None  # the rest is still checked
    try:
        ports = [[free_port(), free_port()] for _ in range(5)]
        args = (ports, str(tmp_path_factory.mktemp("stop") / "backup"), directories)
        outcomes = run_ranks(cases.on_two_workers, [0, 1], args=args, timeout=300)
    finally:
        if directories is not None:
            remove_cgroups(directories)
    for rank, outcome in outcomes.items():
        assert outcome.error is None, (rank, outcome.error)
    return {rank: outcome.value for rank, outcome in outcomes.items()}, directories is not None


@pytest.mark.timeout(360)
def test_a_backward_outside_run_is_refused_with_the_fix_before_any_gradient(two_workers):
    for got in two_workers[0].values():
        refused = got["backward outside run"]
        assert "Received: backward() of the split model's output outside strategy.run" in refused, refused
        assert "inside the step function given to strategy.run" in refused and "sg.fit" in refused, refused
        assert got["no gradient"]


@pytest.mark.timeout(360)
def test_fit_accumulates_gradients_on_a_model_mesh_as_one_device(two_workers):
    assert [got["accumulated trace"] for got in two_workers[0].values()] == [None, None]  # fit(trace=False)
    for name, value in cases.fit_one_device_accumulated(2).items():
        worst = float(abs(two_workers[0][0]["accumulated"][name] - value.numpy()).max() / value.abs().max())
        assert worst <= 1e-9, f"{name} {worst:.2e} relative"


@pytest.mark.timeout(360)
def test_accumulating_on_a_data_axis_is_refused_by_name(two_workers):
    for got in two_workers[0].values():
        refused = got["no_sync on a data axis"]
        assert "on a 'data' axis (no_sync, fit's accumulate_steps) is not supported yet" in refused, refused
        assert "Received: no_sync() on the mesh (2, 1) ('data', 'model')" in refused, refused


@pytest.mark.timeout(360)
def test_a_sigterm_to_one_model_worker_stops_both_after_the_same_step(two_workers):
    # Each worker samples its stop request at its own moment; the step's sums across the data axis alone left one
    # worker stopping (and saving) while the other went on into the next step, until the grace period killed both.
    assert two_workers[0][0]["stopped"] == two_workers[0][1]["stopped"] == [143, 3]


@pytest.mark.timeout(360)
def test_a_plan_over_the_cgroup_limit_is_refused_in_distribute_with_a_mesh_that_fits(two_workers):
    if not two_workers[1]:
        pytest.skip("no cgroup v1 memory controller this test can write (run as root with cgroup v1)")
    for got in two_workers[0].values():
        refused = got["over the limit"]
        assert refused.startswith("TensorParallelStrategy on the mesh (2,) ('model',)'s memory plan needs "), refused
        assert "cgroup v1 /stratagem-test-" in refused and "(memory.limit_in_bytes)" in refused, refused
        assert "Use the mesh (" in refused and "('model',)" in refused, refused
        assert not got["split"]  # refused before any parameter was placed


def _train(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "stratagem", "train", "--strategy", "tensor_parallel", "--workers", "2", *args],
        env=dict(environ.current()),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(400)
def test_stratagem_train_on_two_workers_backs_up_on_sigterm_and_a_rerun_resumes_where_it_stopped(tmp_path):
    # The digits conv net: its first convolution takes the plain batch, which DTensor's convolution backward did not.
    backup = tmp_path / "backup"
    args = ("--batch-size", "16", "--json", "--backup-dir", str(backup))  # 90 steps an epoch
    job = _train("--epochs", "20", *args)
    deadline = time.monotonic() + 240
    while not (backup / "backup.dcp").is_dir():  # renamed into place whole, after epoch 1
        assert job.poll() is None and time.monotonic() < deadline, job.communicate(timeout=60)[1][-3000:]
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 143, err[-3000:]
    assert "[worker:0] WARNING stratagem.train.fit: Stopped by SIGTERM" in err, err[-3000:]
    stopped = json.loads((backup / "backup.dcp" / "manifest.json").read_text())
    epochs = stopped["epoch"] + 1  # the rerun ends with the epoch the stop came in
    rerun = _train("--epochs", str(epochs), *args)
    out, err = rerun.communicate(timeout=240)
    assert rerun.returncode == 0, err[-3000:]
    assert f"Resumed from {backup / 'backup.dcp'}: epoch {epochs} of {epochs}, after step {stopped['step']}" in err
    report = json.loads(out)
    assert report["strategy"] == "TensorParallelStrategy"
    # The data position carried over: every example of each epoch trained on once, across the two runs.
    assert report["num_resumed_examples"] == stopped["epoch"] * 1437 + stopped["step_in_epoch"] * 16
    assert report["num_resumed_examples"] + report["num_train_examples"] == epochs * 1437
