"""MultiWorkerMirroredStrategy across real processes on 127.0.0.1: equivalence and faults."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cases import BATCH_SIZES, TOL, build, make_batches, train_reference
from helpers import free_port

from stratagem import environ
from stratagem.cluster import allocator, launch

WORKER = str(Path(__file__).parent / "workers" / "mwms_train.py")
pytestmark = [pytest.mark.multiprocess]


def run_launched(tmp_path, workers: int, **settings) -> tuple[int, list[str], dict]:
    out = tmp_path / "result.pt"
    env = dict(environ.current())
    env.update({k: str(v) for k, v in settings.items()})
    env["MW_OUT"] = str(out)
    lines: list[str] = []
    result = launch(
        [sys.executable, WORKER],
        workers=workers,
        env=env,
        sink=lambda line: lines.append(f"[{line.task}] {line.text}"),
        timeout=120,
        grace_period=2,
    )
    saved = torch.load(out) if out.exists() else {}
    return result.exit_code, lines, saved


def reference_state(model_name, opt_name, dtype, sizes=BATCH_SIZES):
    reference, ref_opt, shape = build(model_name, opt_name, dtype)
    train_reference(reference, ref_opt, make_batches(shape, dtype, sizes=sizes))
    return reference.state_dict()


SUMS = {
    "0": "cross-worker sums: gloo - turned off (shared_memory=False)",
    "1": "cross-worker sums: shared memory - all ",
    "": "cross-worker sums: shared memory - all 2 workers run on this host",
}  # the default, on one host


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "workers,local,model_name,opt_name,shm",
    [
        (2, 1, "mlp", "sgd_momentum", ""),
        (3, 1, "conv", "adam", "1"),
        (2, 2, "mlp", "adam", "1"),
        (2, 1, "mlp", "sgd_momentum", "0"),
        (3, 1, "conv", "adam", "0"),
    ],
    ids=["2x1-mlp-sgd", "3x1-conv-adam", "2x2-mlp-adam", "2x1-mlp-sgd-gloo", "3x1-conv-adam-gloo"],
)
def test_workers_match_one_device(tmp_path, workers, local, model_name, opt_name, shm):
    code, lines, saved = run_launched(
        tmp_path, workers, MW_MODEL=model_name, MW_OPT=opt_name, MW_LOCAL=local, MW_SHM=shm
    )
    assert code == 0, "\n".join(lines[-30:])
    expected = reference_state(model_name, opt_name, torch.float64)
    for key, value in expected.items():
        torch.testing.assert_close(saved["state"][key], value, **TOL[torch.float64])
    assert saved["steps"] == len(BATCH_SIZES)
    assert f"{workers * local} replica(s) in sync" in saved["explain"]
    assert "techniques: replication on data" in saved["explain"]  # multi_worker/techniques.py, applied
    assert SUMS[shm] in saved["explain"], saved["explain"]
    if allocator.READS_TUNABLES:  # stratagem launch gave the workers glibc's thresholds for keeping freed memory
        assert "freed host memory: kept for reuse" in saved["explain"], saved["explain"]


def _tf_config_env(ports, index, **settings):
    env = dict(environ.current())
    env["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": index}}
    )
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env.update({k: str(v) for k, v in settings.items()})
    return env


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "gloo"])
def test_a_worker_killed_mid_training_is_named_by_the_survivor(tmp_path, shm):
    ports = [free_port(), free_port()]
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER],
            env=_tf_config_env(ports, i, MW_KILL_RANK=1, MW_KILL_STEP=2, MW_TIMEOUT=30, MW_SHM=shm),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    start = time.monotonic()
    _, err0 = procs[0].communicate(timeout=90)
    procs[1].wait(timeout=30)
    assert procs[1].returncode == -9
    assert procs[0].returncode != 0
    assert time.monotonic() - start < 60, "the survivor should not wait out its whole timeout"
    assert "worker:1 (rank 1)" in err0, err0[-2000:]
    # Seen as a failure rather than waited out: Gloo's error, or the shared-memory wait finding the pid gone.
    assert "failed (" in err0, err0[-2000:]
    if shm == "1":
        assert "exited during the shared-memory" in err0, err0[-2000:]


@pytest.mark.timeout(120)
def test_a_worker_that_never_starts_is_named_at_rendezvous(tmp_path):
    ports = [free_port(), free_port()]
    proc = subprocess.run(
        [sys.executable, "-c", ("import stratagem as sg\nsg.MultiWorkerMirroredStrategy(timeout=3)\n")],
        env=_tf_config_env(ports, 0),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode != 0
    assert "CollectiveTimeoutError" in proc.stderr and "worker:1" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.timeout(120)
def test_shared_memory_demanded_where_it_cannot_work_is_an_error(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            ("import stratagem as sg\nsg.MultiWorkerMirroredStrategy(timeout=10, shared_memory=True)\n"),
        ],
        env=_tf_config_env([free_port()], 0),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode != 0
    assert (
        "shared_memory=True, but the workers cannot sum through shared memory. Received: one worker" in proc.stderr
    ), proc.stderr[-2000:]


@pytest.mark.timeout(120)
def test_workers_with_different_models_get_an_error_naming_the_first_mismatch(tmp_path):
    code, lines, _ = run_launched(tmp_path, 2, MW_WIDE_RANK=1)
    assert code != 0
    text = "\n".join(lines)
    assert "worker:1 has '2.weight' of shape (17, 16)" in text and "(16, 16)" in text, text[-3000:]


@pytest.mark.timeout(120)
def test_a_file_dataset_is_sharded_by_file(tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    g = torch.Generator().manual_seed(0)
    for i in range(4):  # 4 files of 6 examples; 2 workers read 2 files each, 3 examples per step
        torch.save(
            (torch.randn(6, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (6,), generator=g)),
            files / f"part-{i}.pt",
        )
    code, lines, saved = run_launched(tmp_path, 2, MW_FILES=files)
    assert code == 0, "\n".join(lines[-30:])
    assert saved["steps"] == 4
    assert "input sharding: file" in saved["explain"]


_CLOSE_SCRIPT = """
import atexit, json, os, sys
import torch, torch.nn.functional as F
import stratagem as sg

def threads():
    return len(os.listdir("/proc/self/task"))

def report():  # registered first, so it runs after stratagem's own exit handler
    print(json.dumps({"start": start, "trained": trained, "closed": threads()}), flush=True)

torch.set_num_threads(1)
start = threads()
atexit.register(report)
strategy = sg.MultiWorkerMirroredStrategy(timeout=60)
net = torch.nn.Linear(4, 2)
model, optimizer = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1))

def step(x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss

for batch in strategy.distribute_dataset([(torch.randn(8, 4), torch.randn(8, 2))] * 3):
    strategy.run(step, args=batch)
trained = threads()
if sys.argv[1] == "close":
    strategy.close()
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc (Linux)")
@pytest.mark.parametrize("ending", ["close", "exit"], ids=["close()", "no-close-at-exit"])
def test_the_process_group_is_freed_so_its_threads_end_before_exit(ending):
    # Gloo's threads must end while Python is alive, at close() or, for a script that never calls it, at
    # exit: one left running into interpreter shutdown aborts the process when it releases a finished
    # collective (SIGABRT after a successful run).
    port = free_port()
    env = dict(
        environ.current(),
        TF_CONFIG=json.dumps({"cluster": {"worker": [f"127.0.0.1:{port}"]}, "task": {"type": "worker", "index": 0}}),
    )
    done = subprocess.run(
        [sys.executable, "-c", _CLOSE_SCRIPT, ending], check=False, env=env, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["trained"] > counts["start"] + 1, counts  # Gloo's threads were there
    assert counts["closed"] <= counts["start"] + 1, counts  # only the chief's TCP store thread remains
