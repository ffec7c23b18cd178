"""A backup written under a tensor-parallel layout resumes under another (2 model workers to 1) exactly, and
`stratagem checkpoint export` writes the whole model from it."""

from __future__ import annotations

import pytest
import torch

import tensor_parallel_checkpoint_cases as cases
from helpers import free_port, run_ranks
from stratagem.train.backup.report import export_model

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.timeout(400)
def test_a_backup_at_two_model_workers_resumes_at_one_and_exports_the_whole_model(tmp_path):
    ports = [free_port(), free_port()]
    written = run_ranks(cases.write_at_two, [0, 1], args=(ports, str(tmp_path)), timeout=240)
    for outcome in written.values():
        assert outcome.error is None, outcome.error
    resumed = run_ranks(cases.resume_at_one, [0], args=([free_port()], str(tmp_path)), timeout=240)
    assert resumed[0].error is None, resumed[0].error
    at_two, at_one = written[0].value, resumed[0].value
    # Each part read back where it now lies (the whole tensor on one worker): the very values written.
    for name, value in at_two["after one"].items():
        assert (at_one["loaded"][name] == value).all(), name
    # The next step at one worker is the next step at two, to rounding (both equal one device within 1e-9).
    for name, value in at_two["after two"].items():
        worst = abs(at_one["after two"][name] - value).max() / abs(value).max()
        assert worst <= 1e-9, f"{name}: {worst:.2e} relative"

    target = tmp_path / "model.pt"
    export_model(tmp_path, target)
    exported = torch.load(target)
    assert set(exported) >= set(at_two["after one"]) and "lm_head.weight" in exported  # tied: both names
    for name, value in at_two["after one"].items():
        assert (exported[name].numpy() == value).all(), name
    assert torch.equal(exported["lm_head.weight"], exported["transformer.wte.weight"])
