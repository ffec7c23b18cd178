"""A backup written under a tensor-parallel layout resumes under another (2 model workers to 1 and to 3) exactly,
and `stratagem checkpoint export` writes the whole model from it."""

from __future__ import annotations

import pytest
import tensor_parallel_checkpoint_cases as cases
import torch
from helpers import free_port, run_ranks
from safetensors.torch import load_file

from stratagem.cli.main import main

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.timeout(400)
def test_a_backup_on_a_2x2_data_and_model_mesh_resumes_at_two_model_workers(tmp_path):
    ports = [free_port() for _ in range(4)]
    written = run_ranks(cases.write_at_two, range(4), args=(ports, str(tmp_path)), timeout=300)
    for outcome in written.values():
        assert outcome.error is None, outcome.error
    at_2x2 = written[0].value
    ports = [free_port(), free_port()]
    resumed = run_ranks(cases.resume, [0, 1], args=(ports, str(tmp_path)), timeout=240)
    for outcome in resumed.values():
        assert outcome.error is None, outcome.error
    there = resumed[0].value
    for name, value in at_2x2["after one"].items():  # the data axis's copies were written once, read back whole
        assert (there["loaded"][name] == value).all(), name
    for name, value in at_2x2["after two"].items():
        worst = abs(there["after two"][name] - value).max() / abs(value).max()
        assert worst <= 1e-9, f"{name} {worst:.2e} relative"


@pytest.mark.timeout(500)
def test_a_backup_at_two_model_workers_resumes_at_one_and_three_and_exports_the_whole_model(tmp_path):
    ports = [free_port(), free_port()]
    written = run_ranks(cases.write_at_two, [0, 1], args=(ports, str(tmp_path)), timeout=240)
    for outcome in written.values():
        assert outcome.error is None, outcome.error
    at_two = written[0].value
    for workers in (1, 3):  # 3: the vocabulary's 2049 rows as 683 each, the heads 2 a worker
        ports = [free_port() for _ in range(workers)]
        resumed = run_ranks(cases.resume, range(workers), args=(ports, str(tmp_path)), timeout=240)
        for outcome in resumed.values():
            assert outcome.error is None, outcome.error
        there = resumed[0].value
        # Each part read back where it now lies: the very values written.
        for name, value in at_two["after one"].items():
            assert (there["loaded"][name] == value).all(), f"{workers} worker(s): {name}"
        # The next step there is the next step at two, to rounding (each equals one device within 1e-9).
        for name, value in at_two["after two"].items():
            worst = abs(there["after two"][name] - value).max() / abs(value).max()
            assert worst <= 1e-9, f"{workers} worker(s): {name} {worst:.2e} relative"

    # `stratagem checkpoint export`, in one process: the whole model, as torch.save and as safetensors.
    target = tmp_path / "model.pt"
    assert main(["checkpoint", "export", str(tmp_path), str(target)]) == 0
    assert main(["checkpoint", "export", str(tmp_path), str(tmp_path / "model.safetensors")]) == 0
    for exported in (torch.load(target), load_file(str(tmp_path / "model.safetensors"))):
        assert set(exported) >= set(at_two["after one"]) and "lm_head.weight" in exported  # tied: both names
        for name, value in at_two["after one"].items():
            assert (exported[name].numpy() == value).all(), name
        assert torch.equal(exported["lm_head.weight"], exported["transformer.wte.weight"])
