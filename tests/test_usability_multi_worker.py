"""gather and the chief-only callbacks under MultiWorkerMirroredStrategy: one launched job of 2 workers
with 2 local replicas each (tests/workers/usability_mw.py)."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from cases import TOL, build, make_batches, train_reference
from helpers import launch_workers

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.timeout(180)
def test_gather_and_callbacks_across_two_workers(tmp_path):
    exit_code, output = launch_workers("usability_mw.py", {"UW_OUT": str(tmp_path)}, timeout=150)
    assert exit_code == 0, output
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in range(2):
        gathered = seen[rank]["gather"]
        assert gathered["x2"] == [2.0 * i for i in range(7)]  # every worker gets the whole, in order
        assert gathered["n"] == [2, 2, 2, 1]
        assert gathered["names"] == [f"ex{i}" for i in range(7)]
        assert gathered["ranks"] == [0.0, 1.0]
    # seed_everything: every worker draws the same numbers (their shuffles of the global batches agree).
    assert seen[0]["draw"] == seen[1]["draw"] == _first_draw(11)
    # The callbacks: both workers stop after epoch 3 and hold the restored epoch-1 weights; only the chief wrote.
    assert [s["fit"] for s in seen] == [{"epochs": 3, "stopped": 3}] * 2
    expected = reference_after(1)
    for rank in range(2):
        got = torch.load(tmp_path / f"state{rank}.pt", weights_only=True)
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], **TOL[torch.float64])
    files = tmp_path / "files0"
    assert sorted(p.name for p in files.iterdir()) == [
        "epoch1.safetensors",
        "epoch2.safetensors",
        "epoch3.safetensors",
        "log.csv",
        "tb",
    ]
    assert len(list(csv.DictReader((files / "log.csv").open()))) == 3
    assert list((files / "tb").iterdir())
    assert not (tmp_path / "files1").exists()


def _first_draw(seed: int) -> float:
    torch.manual_seed(seed)
    return float(torch.rand(1))


def reference_after(epochs: int) -> dict:
    model, optimizer, shape = build("mlp", "sgd_momentum", torch.float64)
    train_reference(
        model, optimizer, make_batches(shape, torch.float64, sizes=[12, 11, 7, 5]), clip=False, epochs=epochs
    )
    return model.state_dict()
