"""Several models and optimizers in one step under MultiWorkerMirroredStrategy (2 workers on 127.0.0.1, one and
two local replicas each) equal one device: tests/workers/several_models_train.py against several_models_cases."""

from __future__ import annotations

import pytest
import torch

from cases import TOL
from helpers import launch_workers
from several_models_cases import reference_distillation, reference_gan

pytestmark = [pytest.mark.multiprocess]


def _close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, **TOL[torch.float64], msg=lambda m, k=key: f"{what} {k}: {m}")


@pytest.mark.timeout(300)
def test_a_gan_a_teacher_and_an_ema_under_two_workers_equal_one_device(tmp_path):
    out = tmp_path / "out.pt"
    code, output = launch_workers("several_models_train.py", {"MW_OUT": str(out)}, timeout=240)
    assert code == 0, output
    g, d, ema, hand = reference_gan()
    teacher, student = reference_distillation()
    want = {"g": g, "d": d, "teacher": teacher, "student": student}
    results = torch.load(out, weights_only=False)
    assert set(results) == {"1 local", "2 local"}
    for case, saved in results.items():
        for name, model in want.items():
            for r, state in enumerate(saved["models"][name]):
                _close(state, model.state_dict(), f"{case}, {name} replica {r}:")
        _close(saved["ema"], ema.state_dict(), f"{case}, torch's EMA:")
        _close(saved["hand"], hand.state_dict(), f"{case}, hand-written EMA:")
        assert saved["module"] == "Sequential"  # .module is the plain model under MultiWorkerMirrored too
        assert "replica(s) in sync" in saved["explain"]
