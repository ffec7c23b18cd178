"""TensorParallelStrategy against plain PyTorch on one device: a tiny GPT-2, AdamW, clipping, -100 labels."""

from __future__ import annotations

import pytest
import tensor_parallel_cases
from helpers import free_port, run_ranks

pytestmark = [pytest.mark.multiprocess]


def _check(outcomes: dict, world: int) -> dict:
    for outcome in outcomes.values():
        assert outcome.error is None, outcome.error
    for rank, outcome in outcomes.items():
        result = outcome.value
        assert result["worst"] <= 1e-9, f"rank {rank}: parameters off by {result['worst']:.2e} relative"
        assert result["norms"] <= 1e-9, (
            f"rank {rank}: clip_grad_norm_ off by {result['norms']:.2e}: not the global norm"
        )
        assert result["losses"] <= 1e-9, f"rank {rank}: reported loss off by {result['losses']:.2e}"
        assert result["same model"]
    return outcomes[0].value


@pytest.mark.timeout(240)
def test_gpt2_split_over_two_model_workers_equals_one_device():
    world = 2
    ports = [free_port() for _ in range(world)]
    outcomes = run_ranks(tensor_parallel_cases.exactness, range(world), args=(ports, (2,), ("model",)), timeout=220)
    result = _check(outcomes, world)
    # 2049 rows over 2 workers: 1025 and 1024, no padding.
    assert outcomes[0].value["wte local"] == (1025, 48) and outcomes[1].value["wte local"] == (1024, 48)
    assert "transformer.wte.weight = lm_head.weight (2049, 48): ('model', None)" in result["explain"]
    assert "mesh: (2,) ('model',)" in result["explain"]
    assert "all-reduce of the partial output" in result["explain"]


@pytest.mark.timeout(300)
def test_gpt2_split_over_three_model_workers_equals_one_device():
    world = 3
    ports = [free_port() for _ in range(world)]
    outcomes = run_ranks(tensor_parallel_cases.exactness, range(world), args=(ports, (3,), ("model",)), timeout=280)
    _check(outcomes, world)
    assert [outcomes[r].value["wte local"][0] for r in range(3)] == [683, 683, 683]


@pytest.mark.timeout(400)
def test_gpt2_on_a_two_by_two_mesh_with_an_uneven_batch_equals_one_device():
    world = 4
    ports = [free_port() for _ in range(world)]
    args = (ports, (2, 2), ("data", "model"))
    outcomes = run_ranks(tensor_parallel_cases.exactness, range(world), args=args, timeout=380)
    result = _check(outcomes, world)
    assert "data axis: all-reduce (SUM)" in result["explain"]
