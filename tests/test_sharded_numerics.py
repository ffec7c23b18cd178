"""ShardedStrategy on 2 processes against plain PyTorch on one device, beyond the MLP: a ResNet-style net whose
BatchNorm layers use the global batch's statistics, a bf16 MixedPrecisionPolicy, tiny GPT-2 in float32 and with
AdamW (13 examples split 7/6, as in tests/test_sharded_exact.py)."""

from __future__ import annotations

import pytest
import sharded_numerics_cases
from amp_cases import BF16_EPS
from helpers import free_port, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.sharded]


@pytest.mark.timeout(300)
def test_batch_norm_bf16_and_gpt2_train_as_one_device():
    ports = [(free_port(), free_port()) for _ in range(7)]  # one cluster per strategy the ranks build
    outcomes = run_ranks(sharded_numerics_cases.numerics_cases, [0, 1], args=(ports,), timeout=280)
    for outcome in outcomes.values():
        assert outcome.error is None, outcome.error
    for rank, outcome in outcomes.items():
        got = outcome.value
        # Global BatchNorm statistics: parameters, running means and variances and batch counts as one device's.
        for dtype, tolerance in (("float64", 1e-9), ("float32", 1e-5)):
            case = got[f"batch norm {dtype}"]
            assert case["worst"] <= tolerance, (rank, dtype, case["worst"], case["where"])
            assert case["eval"] <= 1e3 * tolerance, (rank, dtype, case["eval"])
        explained = got["batch norm float64"]["explain"]
        assert "BatchNorm statistics: global batch" in explained
        assert "5 layer(s)" in explained
        # bf16: every parameter tensor within bfloat16's epsilon of its largest magnitude (tests/test_autocast.py).
        for name, error in got["bf16 policy"].items():
            assert error <= BF16_EPS, (rank, name, error)
        # AdamW is exact in float64; in float32 SGD is exact to 1e-5, while AdamW turns float32 rounding of
        # gradients that are zero in exact arithmetic (GPT-2's key bias) into steps of lr: docs/sharded.md.
        assert got["gpt2 float64 adamw"]["worst"] <= 1e-9, (rank, got["gpt2 float64 adamw"])
        assert got["gpt2 float32 sgd"]["worst"] <= 1e-5, (rank, got["gpt2 float32 sgd"])
        # A rank that built another model is named on every rank, with its shard and the plan's.
        refused = got["other dtype on rank 1"]
        assert "Every rank must shard the same model" in refused
        assert (
            "worker:1 (rank 1): '0.weight' has a shard of (8, 6) float64 (whole (17, 6)), the plan (8, 6) float32"
            in refused
        )
        # No whole copy left behind: the user's module is the sharded one, and none of its whole tensors lives on.
        in_place = got["sharded in place"]
        assert in_place["same module"] is True
        assert in_place["whole parameters alive"] == 0, in_place
        assert in_place["local rows"] == [
            (rows + 1) // 2 if rank == 0 else rows // 2 for rows in in_place["whole rows"]
        ]
