"""Every script in examples/ runs as a user would run it and learns the toy problem.

The mirrored, central storage, model parallel and multi-worker examples train the same network on
the same global batches with the same optimizer, so they must print the same losses: the examples
double as an equivalence check.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
EPOCH_LINE = re.compile(r"epoch (\d+): loss (\d+\.\d+)")


def run_example(*command: str, timeout: float = 120) -> list[float]:
    done = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}"
    losses = [float(m.group(2)) for m in EPOCH_LINE.finditer(done.stdout)]
    assert len(losses) == 5, f"expected five epoch lines from {command}, got:\n{done.stdout}"
    return losses


def assert_learns(losses: list[float]) -> None:
    assert losses[-1] < 0.5 * losses[0], f"the loss did not fall by half: {losses}"


@pytest.fixture(scope="module")
def mirrored_losses() -> list[float]:
    return run_example(sys.executable, str(EXAMPLES / "mirrored.py"))


@pytest.mark.timeout(150)
def test_one_device_example_learns() -> None:
    assert_learns(run_example(sys.executable, str(EXAMPLES / "one_device.py")))


@pytest.mark.timeout(150)
def test_mirrored_example_learns(mirrored_losses: list[float]) -> None:
    assert_learns(mirrored_losses)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", ["central_storage", "model_parallel"])
def test_synchronous_example_matches_mirrored(name: str, mirrored_losses: list[float]) -> None:
    # Same network, data and optimizer as examples/mirrored.py: synchronous strategies must agree.
    assert run_example(sys.executable, str(EXAMPLES / f"{name}.py")) == pytest.approx(mirrored_losses, abs=2e-4)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_multi_worker_example_matches_mirrored(mirrored_losses: list[float]) -> None:
    launched = run_example(
        sys.executable, "-m", "stratagem", "launch", "--workers", "2", str(EXAMPLES / "multi_worker.py"), timeout=180
    )
    assert_learns(launched)
    assert launched == pytest.approx(mirrored_losses, abs=2e-4)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_parameter_server_example_learns_on_a_local_cluster() -> None:
    assert_learns(
        run_example(
            sys.executable,
            "-m",
            "stratagem",
            "launch",
            "--workers",
            "2",
            "--ps",
            "1",
            str(EXAMPLES / "parameter_server.py"),
            timeout=180,
        )
    )


FIT_SUMMARY = re.compile(r"losses \[(.*)\], final validation accuracy (\d\.\d+)")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["one_device", "model_parallel"])
def test_fit_example_runs_every_strategy(strategy: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "fit.py"), strategy],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    summary = FIT_SUMMARY.search(done.stdout)
    assert summary, done.stdout
    losses = [float(v) for v in summary.group(1).split(",")]
    assert_learns(losses)
    assert float(summary.group(2)) > 0.9
    assert not (tmp_path / "stratagem-example-fit").exists()  # the backup is removed when training finishes
