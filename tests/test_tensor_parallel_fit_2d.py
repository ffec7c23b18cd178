"""sg.fit drives TensorParallelStrategy on a 2 x 2 (data, model) mesh with weights also sharded along `data`
(ZeRO-3), backs up every step, and a run on 2 model workers (one axis) resumes from its backup where it stopped,
mid-epoch: every run's last step equal to one device's (the tiny GPT-2 of tensor_parallel_cases, float64, AdamW,
clipping)."""

from __future__ import annotations

import pytest
import tensor_parallel_fit_cases as cases
from helpers import free_port, run_ranks

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.timeout(400)
def test_fit_with_zero3_on_a_2x2_mesh_resumes_on_one_model_axis_as_one_device_trains(tmp_path):
    directory = str(tmp_path / "backup")
    written = run_ranks(cases.fit_zero3_2d, range(4), args=([free_port() for _ in range(4)], directory), timeout=300)
    for outcome in written.values():
        assert outcome.error is None, outcome.error
    resumed = run_ranks(cases.fit_resumed_1d, [0, 1], args=([free_port(), free_port()], directory), timeout=240)
    for outcome in resumed.values():
        assert outcome.error is None, outcome.error
    assert written[0].value["restored from"] is None
    assert resumed[0].value["restored from"] == {"epoch": 1, "step": 4}  # the data position carried over
    for run, steps in ((written[0].value, 4), (resumed[0].value, 6)):
        for name, value in cases.fit_one_device(steps).items():
            worst = float(abs(run["whole"][name] - value.numpy()).max() / value.abs().max())
            assert worst <= 1e-9, f"step {steps}: {name} {worst:.2e} relative"
