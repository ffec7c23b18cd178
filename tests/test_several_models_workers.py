"""Several models and optimizers in one step under MultiWorkerMirroredStrategy (workers on 127.0.0.1) equal one
device: tests/workers/several_models_train.py against several_models_cases, with 2 workers of one and two local
replicas each, and 3 workers of one; gradient buckets of about 200 bytes, so the larger layers' gradients are summed
in place (direct) and the others fused."""

from __future__ import annotations

import pytest
import torch
from cases import TOL
from helpers import launch_workers
from several_models_cases import reference_distillation, reference_gan, reference_routed, reference_token_gan

pytestmark = [pytest.mark.multiprocess]

BUCKET_MB = str(200 / 2**20)


def _close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, **TOL[torch.float64], msg=lambda m, k=key: f"{what} {k}: {m}")


def _check(results: dict, cases: set[str]) -> None:
    g, d, ema, hand = reference_gan()
    teacher, student = reference_distillation()
    token_g, token_d = reference_token_gan()
    want = {
        "g": g,
        "d": d,
        "teacher": teacher,
        "student": student,
        "token g": token_g,
        "token d": token_d,
        "routed": reference_routed(),
    }
    assert set(results) == cases
    for case, saved in results.items():
        for name, model in want.items():
            for r, state in enumerate(saved["models"][name]):
                _close(state, model.state_dict(), f"{case}, {name} replica {r}:")
        _close(saved["ema"], ema.state_dict(), f"{case}, torch's EMA:")
        _close(saved["hand"], hand.state_dict(), f"{case}, hand-written EMA:")
        assert saved["module"] == "Sequential"  # .module is the plain model under MultiWorkerMirrored too
        assert "replica(s) in sync" in saved["explain"]
    # Combined locally, then across workers: the discriminator's pass leaves the generator's gradient bit for bit.
    if "2 local" in results:
        assert results["2 local"]["kept gradient changes"] == [0.0] * 2 * 4


@pytest.mark.timeout(300)
def test_a_gan_a_teacher_and_an_ema_under_two_workers_equal_one_device(tmp_path):
    out = tmp_path / "out.pt"
    settings = {"MW_OUT": str(out), "MW_CASES": "1,2", "MW_BUCKET_MB": BUCKET_MB}
    code, output = launch_workers("several_models_train.py", settings, timeout=240)
    assert code == 0, output
    _check(torch.load(out, weights_only=False), {"1 local", "2 local"})


@pytest.mark.timeout(300)
def test_a_gan_a_teacher_and_an_ema_under_three_workers_equal_one_device(tmp_path):
    out = tmp_path / "out.pt"
    settings = {"MW_OUT": str(out), "MW_CASES": "1", "MW_BUCKET_MB": BUCKET_MB}
    code, output = launch_workers("several_models_train.py", settings, timeout=240, workers=3)
    assert code == 0, output
    _check(torch.load(out, weights_only=False), {"1 local"})
