"""TensorParallelStrategy against plain PyTorch on one device: a tiny GPT-2, AdamW, clipping, -100 labels.

Each launch also builds the strategy as a script does, `sg.strategy_from_env(layout_map=...)`, in one launcher's
environment (torchrun's, SLURM's, `stratagem launch --strategy tensor_parallel`'s), and shows a layer split along its
output features holding 1/N of its activations on each worker."""

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
    # Under torchrun's variables, with a layout map given no mesh: one `model` axis over every worker.
    args = (ports, None, None, False, None, "torchrun")
    outcomes = run_ranks(tensor_parallel_cases.exactness, range(world), args=args, timeout=220)
    result = _check(outcomes, world)
    assert (result["strategy"], result["cluster source"]) == ("TensorParallelStrategy", "torchrun")
    # 2049 rows over 2 workers: 1025 and 1024, no padding.
    assert outcomes[0].value["wte local"] == (1025, 48) and outcomes[1].value["wte local"] == (1024, 48)
    assert "transformer.wte.weight = lm_head.weight (2049, 48): ('model', None)" in result["explain"]
    assert "mesh: (2,) ('model',)" in result["explain"]
    # The MLP's first layer, split along its 192 output features: each worker holds 96 of them for 13 x 8 tokens.
    assert [outcomes[r].value["c_fc output"] for r in range(2)] == [((13, 8, 192), (13, 8, 96))] * 2
    assert "all-reduce of the partial output" in result["explain"]


@pytest.mark.timeout(300)
def test_gpt2_split_over_three_model_workers_equals_one_device():
    world = 3
    ports = [free_port() for _ in range(world)]
    args = (ports, (3,), ("model",), False, None, "SLURM")  # srun's variables
    outcomes = run_ranks(tensor_parallel_cases.exactness, range(world), args=args, timeout=280)
    result = _check(outcomes, world)
    assert (result["strategy"], result["cluster source"]) == ("TensorParallelStrategy", "SLURM")
    assert [outcomes[r].value["wte local"][0] for r in range(3)] == [683, 683, 683]
    assert [outcomes[r].value["c_fc output"] for r in range(3)] == [((13, 8, 192), (13, 8, 64))] * 3


@pytest.mark.timeout(400)
def test_gpt2_on_a_two_by_two_mesh_with_an_uneven_batch_equals_one_device():
    world = 4
    ports = [free_port() for _ in range(world)]
    # What `stratagem launch --workers 4 --strategy tensor_parallel` gives each worker (TF_CONFIG, torchrun's
    # variables, STRATAGEM_STRATEGY); TF_CONFIG is read first.
    args = (ports, (2, 2), ("data", "model"), False, None, "stratagem launch")
    outcomes = run_ranks(tensor_parallel_cases.exactness, range(world), args=args, timeout=380)
    result = _check(outcomes, world)
    assert (result["strategy"], result["cluster source"]) == ("TensorParallelStrategy", "TF_CONFIG")
    assert "data axis: all-reduce (SUM)" in result["explain"]
    # Each model group's slice of the 13 (7 and 6 sequences), its 192 features split over the group's 2 workers.
    assert [outcomes[r].value["c_fc output"][1] for r in range(4)] == [(7, 8, 96), (7, 8, 96), (6, 8, 96), (6, 8, 96)]
