"""benchmarks/real_models.py keeps working: its smallest mode runs each kind of launch (a plain process,
`stratagem launch`, torchrun) on a tiny GPT-2, the final losses agree and the table has a row for each
configuration; in-process, the benchmark's loops give one device's loss on the ResNet with BatchNorm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import stratagem as sg
from stratagem.bench import real_models as rm
from stratagem.devices import DeviceRegistry

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "real_models.py"
SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.mark.multiprocess
@pytest.mark.timeout(600)  # about 30 s on a quiet 2-core machine; minutes when other jobs share it
def test_the_quick_mode_runs_every_kind_of_launch_and_the_losses_agree(tmp_path):
    out = tmp_path / "real.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    configs = ["plain", "mwms", "ddp"]  # Mirrored's loop: the in-process test below
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--models",
            "gpt2",
            "--configs",
            ",".join(configs),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=560,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (results,) = json.loads(out.read_text())["rounds"]["gpt2"]
    losses = {config: results[config]["ranks"][0]["final_loss"] for config in configs}
    for config, loss in losses.items():
        assert loss == pytest.approx(losses["plain"], rel=1e-5), losses
    assert [len(results[c]["ranks"]) for c in configs] == [1, 2, 2]  # every process reported its peak RSS
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| gpt2 |")]
    assert [row.split(" | ")[1] for row in rows] == [
        "plain PyTorch",
        "MultiWorkerMirrored x2",
        "DDP x2 (torchrun)",
    ]
    assert "MultiWorkerMirrored x2 / DDP x2 (torchrun) >= 1.0" in proc.stdout


def test_an_unknown_configuration_is_refused_with_the_choices():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--configs", "plain,horovod"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
        timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown configuration or model: ['horovod']" in proc.stderr
    assert "mwms" in proc.stderr


@pytest.mark.timeout(240)
def test_mirrored_gives_plain_pytorchs_final_loss_on_the_resnet_with_batch_norm():
    spec = rm.MODELS_QUICK["resnet18"]
    plain = rm.run_plain(spec, warmup=1, steps=2)
    registry = DeviceRegistry()
    registry.set_logical_device_configuration("cpu", 2)
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=registry)
    try:
        mirrored = rm.run_strategy("mirrored", strategy, spec, warmup=1, steps=2)
    finally:
        strategy.close()
    assert mirrored.final_loss == pytest.approx(plain.final_loss, rel=1e-5)
    assert (mirrored.config, mirrored.steps, plain.world) == ("mirrored", 2, 1)
    assert plain.peak_rss_mib > 0 and plain.samples_per_s > 0


def test_each_rank_takes_its_contiguous_half_of_a_global_batch():
    batch = rm.make_batches(rm.MODELS_QUICK["bert"], 1)[0]
    halves = [rm.rank_slice(batch, rank, 2) for rank in range(2)]
    assert halves[0]["input_ids"].tolist() == batch["input_ids"][:2].tolist()
    assert halves[1]["labels"].tolist() == batch["labels"][2:].tolist()
    x, y = rm.rank_slice(rm.make_batches(rm.MODELS_QUICK["resnet18"], 1)[0], 1, 2)
    assert (x.shape[0], y.shape[0]) == (2, 2)


@pytest.mark.timeout(300)
def test_the_in_process_benchmark_times_every_configuration_against_plain_pytorch():
    script = SCRIPT.parent / "in_process.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--models", "resnet18"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if "/ plain samples/s" in line}
    assert sorted(rows) == sorted(["plain", "one_device", "mirrored", "central_storage", "mirrored_per_replica_bn"])
    assert "1.000 (1.000-1.000)" in rows["plain"]
    assert "Mirrored x2 exact / per-replica BatchNorm, step time:" in proc.stdout
