"""The nanoGPT-style port (issue 27, item 10): examples/ports/nanogpt_port.py changes at most 20 lines of
nanogpt_original.py and, in float64, prints the original's losses and final parameters under OneDevice,
Mirrored x2 and `stratagem launch --workers 2`, and resumes from its checkpoint as the original does.

The model keeps minGPT's `self.mlpf = lambda ...` (tests/test_replica_copies.py), accumulates two
micro-batches per update, clips after `GradScaler.unscale_` and writes a cosine schedule into param_groups."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_ports import changed_lines, run_in_process

ROOT = Path(__file__).resolve().parent.parent
PORTS = ROOT / "examples" / "ports"
ARGS = ["--dtype", "float64", "--max-iters", "6", "--eval-interval", "3", "--eval-iters", "1"]
NUMBER = re.compile(r"(?:loss|final:) (-?[0-9.]+)")


def numbers(out: str) -> list[float]:
    """Every loss and the final parameter sum, in the order printed."""
    found = [float(m.group(1)) for line in out.splitlines() for m in NUMBER.finditer(line)]
    assert found, f"nothing printed:\n{out}"
    return found


@pytest.fixture
def restore_dtype():
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


def test_the_nanogpt_port_changes_at_most_20_lines() -> None:
    assert 0 < changed_lines("nanogpt") <= 20


IN_PROCESS = {
    "one_device": {"STRATAGEM_STRATEGY": "one_device", "STRATAGEM_DEVICES": "cpu:0"},
    "mirrored_x2": {"STRATAGEM_STRATEGY": "mirrored", "STRATAGEM_DEVICES": "cpu:0,cpu:1"},
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", sorted(IN_PROCESS))
def test_the_port_prints_the_originals_numbers_and_resumes_alike(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], restore_dtype: None
) -> None:
    original = run_in_process(
        PORTS / "nanogpt_original.py", [*ARGS, "--out-dir", str(tmp_path / "o")], {}, monkeypatch, capsys
    )
    port_dir = ["--out-dir", str(tmp_path / "p")]
    port = run_in_process(PORTS / "nanogpt_port.py", [*ARGS, *port_dir], IN_PROCESS[mode], monkeypatch, capsys)
    assert numbers(port) == pytest.approx(numbers(original), rel=1e-10, abs=1e-12)
    # Resumed from the port's own checkpoint (the best validation loss, at step 3), the run ends where it did.
    resumed = run_in_process(
        PORTS / "nanogpt_port.py", [*ARGS, *port_dir, "--resume"], IN_PROCESS[mode], monkeypatch, capsys
    )
    assert "step 3:" in resumed and "iter 2:" not in resumed  # it started from the checkpoint
    assert numbers(resumed)[-1] == pytest.approx(numbers(original)[-1], rel=1e-10)


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_the_port_under_launch_with_two_workers_prints_the_originals_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], restore_dtype: None
) -> None:
    original = run_in_process(
        PORTS / "nanogpt_original.py", [*ARGS, "--out-dir", str(tmp_path / "o")], {}, monkeypatch, capsys
    )
    command = [sys.executable, "-m", "stratagem", "launch", "--workers", "2", "--timeout", "420"]
    command += [str(PORTS / "nanogpt_port.py"), *ARGS, "--out-dir", str(tmp_path / "p")]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=460, check=False)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    for worker in ("worker:0", "worker:1"):
        lines = "\n".join(line for line in done.stdout.splitlines() if line.startswith(f"[{worker}] "))
        assert numbers(lines) == pytest.approx(numbers(original), rel=1e-10, abs=1e-12), worker
