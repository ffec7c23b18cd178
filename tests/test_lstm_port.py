"""The LSTM word language model port (issue 27, item 10): examples/ports/lstm_port.py stays within 15 changed
lines of lstm_original.py and, in float64, matches it under OneDevice, Mirrored x2 and `stratagem launch
--workers 2`: (seq, batch) batches cut along the batch, the hidden state carried per replica, SGD written by
hand after clipping, and a learning rate annealed between epochs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_ports import PORTS, ROOT, changed_lines, run_in_process, run_original

ARGS = ["--double", "--epochs", "2"]
LOSSES = re.compile(r"(?:valid|test) loss ([0-9.]+)")
MAX_CHANGED = 15


def losses(out: str) -> list[float]:
    found = [float(m) for m in LOSSES.findall(out)]
    assert len(found) == 3, f"expected two valid losses and a test loss, got:\n{out}"
    return found


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], dict[str, torch.Tensor]]:
    saved = tmp_path_factory.mktemp("lstm") / "original.pt"
    done = run_original("lstm_original.py", [*ARGS, "--save", str(saved)])
    return losses(done.stdout), torch.load(saved)


def test_the_lstm_port_changes_at_most_15_lines() -> None:
    assert 0 < changed_lines("lstm") <= MAX_CHANGED


IN_PROCESS = {
    "one_device": {"STRATAGEM_STRATEGY": "one_device", "STRATAGEM_DEVICES": "cpu:0"},
    "mirrored_x2": {"STRATAGEM_STRATEGY": "mirrored", "STRATAGEM_DEVICES": "cpu:0,cpu:1"},
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", sorted(IN_PROCESS))
def test_the_lstm_port_matches_the_original_in_float64(
    mode: str,
    original: tuple[list[float], dict[str, torch.Tensor]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    saved = tmp_path / "port.pt"
    out = run_in_process(PORTS / "lstm_port.py", [*ARGS, "--save", str(saved)], IN_PROCESS[mode], monkeypatch, capsys)
    expected_losses, expected_state = original
    assert losses(out) == pytest.approx(expected_losses, rel=1e-12)
    state = torch.load(saved)
    for key, value in expected_state.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=1e-12, msg=key)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_the_lstm_port_matches_the_original_under_launch_with_two_workers(
    original: tuple[list[float], dict[str, torch.Tensor]],
) -> None:
    command = [sys.executable, "-m", "stratagem", "launch", "--workers", "2", "--timeout", "360"]
    done = subprocess.run(
        [*command, str(PORTS / "lstm_port.py"), *ARGS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=390,
        check=False,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    for worker in (0, 1):  # every worker evaluates the same model
        lines = "\n".join(line for line in done.stdout.splitlines() if line.startswith(f"[worker:{worker}] "))
        assert losses(lines) == pytest.approx(original[0], rel=1e-12), worker
