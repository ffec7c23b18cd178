"""Weights sharded along the `data` axis too (ZeRO-3 on FSDP2, after the tensor-parallel split): a backup of their
shards resumes at another layout exactly."""

from __future__ import annotations

import pytest
import tensor_parallel_cases as cases
import tensor_parallel_checkpoint_cases as checkpoint_cases
from helpers import free_port, run_ranks

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.timeout(400)
def test_a_backup_with_weights_sharded_along_data_resumes_at_two_model_workers(tmp_path):
    ports = [free_port() for _ in range(4)]
    written = run_ranks(cases.write_sharded_along_data, range(4), args=(ports, str(tmp_path)), timeout=300)
    for outcome in written.values():
        assert outcome.error is None, outcome.error
    at_2x2 = written[0].value
    ports = [free_port(), free_port()]
    # Read back at 2 model workers, with no data axis and nothing sharded along it (checkpoint_cases.resume).
    resumed = run_ranks(checkpoint_cases.resume, [0, 1], args=(ports, str(tmp_path)), timeout=240)
    for outcome in resumed.values():
        assert outcome.error is None, outcome.error
    there = resumed[0].value
    for name, value in at_2x2["after one"].items():  # every shard along data read back into its whole
        assert (there["loaded"][name] == value).all(), name
    for name, value in at_2x2["after two"].items():  # AdamW's state too: the next step is the same step
        worst = abs(there["after two"][name] - value).max() / abs(value).max()
        assert worst <= 1e-9, f"{name} {worst:.2e} relative"
