"""TensorParallelStrategy's memory plan: each rank's parts worked out from the layouts by hand, and against the
bytes a rank holds after a step."""

from __future__ import annotations

import pytest
import tensor_parallel_memory_cases as cases
import torch
from helpers import free_port, run_ranks

import stratagem as sg
from stratagem.strategies.tensor_parallel.decisions import layout_decisions
from stratagem.strategies.tensor_parallel.memory import plan_tensor_parallel_memory
from stratagem.strategies.tensor_parallel.mesh import resolve_layouts

# Linear(8, 5) split by rows (3 and 2 of 5), Linear(5, 3) by input features (3 and 2 of 5 columns), its bias whole;
# float64, so 8 bytes an element.
LOCAL = {0: (3 * 8 + 3 + 3 * 3 + 3) * 8, 1: (2 * 8 + 2 + 3 * 2 + 3) * 8}  # 312 and 216 bytes
LARGEST_PART = {0: 3 * 8 * 8, 1: 2 * 8 * 8}  # the first weight's rows
WHOLE = (40 + 5 + 15 + 3) * 8  # 504 bytes, of which the first weight is 320
FIRST_WEIGHT = 40 * 8  # the largest split parameter, whole: its gradient before it is reduced into the part


def _plan(mesh: sg.DeviceMesh, rank: int, activations: int = 0):
    model = cases.mlp()
    named = [(n, p, tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=False)]
    layouts = resolve_layouts(cases.layout_map(mesh), mesh, named)
    optimizer = torch.optim.AdamW(model.parameters())
    return plan_tensor_parallel_memory(
        layouts, dict(model.named_parameters()), optimizer, mesh=mesh, rank=rank, activations=activations
    )


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_plans_its_own_parts_the_optimizer_state_and_the_peak(rank):
    plan = _plan(sg.DeviceMesh((2,), ("model",)), rank)
    local = LOCAL[rank]
    assert (plan.parameters, plan.gradients) == (local, local)
    assert plan.optimizer_state == 2 * local + 4 * 4  # AdamW's two moments, and four float32 step counters
    assert plan.optimizer_temporaries == 2 * LARGEST_PART[rank]
    assert plan.gradient_redistribution == FIRST_WEIGHT
    assert plan.data_axis_buffers == 0
    assert plan.whole_model == WHOLE
    assert plan.distribute_peak == WHOLE + local + FIRST_WEIGHT
    transient = max(2 * LARGEST_PART[rank], FIRST_WEIGHT)  # rank 0: Adam's two tensors; rank 1: the whole gradient
    assert plan.training_peak == local + plan.optimizer_state + local + transient
    assert plan.total == max(plan.training_peak, plan.distribute_peak) == {0: 1648, 1: 1200}[rank]
    assert "activations not counted" in str(plan)


def test_activations_above_the_gradients_set_the_step_peak():
    plan = _plan(sg.DeviceMesh((2,), ("model",)), 0, activations=10_000)
    assert plan.training_peak == 312 + 640 + 10_000
    assert plan.total == plan.training_peak and plan.to_dict()["total"] == plan.total


def test_a_data_axis_adds_the_buffer_of_the_largest_local_gradient_and_ranks_follow_their_model_index():
    mesh = sg.DeviceMesh((2, 2), ("data", "model"))
    plans = [_plan(mesh, rank) for rank in range(4)]
    assert [p.parameters for p in plans] == [LOCAL[0], LOCAL[1], LOCAL[0], LOCAL[1]]
    assert [p.data_axis_buffers for p in plans] == [192, 128, 192, 128]
    assert plans[3].training_peak == 216 + 448 + 216 + 128 + FIRST_WEIGHT


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_the_plan_is_what_each_rank_holds_after_a_step_and_measuring_activations_changes_nothing():
    ports = [free_port(), free_port()]
    outcomes = run_ranks(cases.plan_against_held, [0, 1], args=(ports,), timeout=180)
    for rank, outcome in outcomes.items():
        assert outcome.error is None, outcome.error
        result = outcome.value
        assert result["before"] == result["after"]  # planned before the split as at distribute
        held, plan = result["held"], result["measured"]
        assert held == {
            "parameters": plan["parameters"],
            "gradients": plan["gradients"],
            "optimizer_state": plan["optimizer_state"],
        }
        assert plan["parameters"] == LOCAL[rank]
        assert plan["activations"] > 0 and plan["activations_how"].startswith("measured")
        assert result["untouched"], "the measuring step left gradients behind"
        assert "memory plan" in result["explain"]
        # The step's one collective along model, counted in the measuring step: the second Linear's partial output
        # (6 rows x 3 features, float64) all-reduced. Backward has none: the input needs no gradient, and the first
        # weight's gradient comes out in its layout.
        assert "model axis: per step: all-reduce 1 x 144 B" in result["explain"], result["explain"]


def test_a_weight_sharded_along_data_is_cut_there_too_and_its_unit_is_planned_whole_along_data():
    mesh = sg.DeviceMesh((2, 2), ("data", "model"))
    model = cases.mlp()
    layout_map = cases.layout_map(mesh)
    layout_map[r"0\.weight"] = ("model", "data")  # its 8 input features: 4 per data worker
    named = [(n, p, tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=False)]
    layouts = resolve_layouts(layout_map, mesh, named)
    optimizer = torch.optim.AdamW(model.parameters())
    plans = [
        plan_tensor_parallel_memory(layouts, dict(model.named_parameters()), optimizer, mesh=mesh, rank=rank)
        for rank in range(4)
    ]
    # model index 0: 3 rows x 4 columns, its bias 3, the second weight's 3 x 3, the last bias 3; index 1: 2 x 4, 2,
    # 3 x 2, 3; float64.
    local = {0: (12 + 3 + 9 + 3) * 8, 1: (8 + 2 + 6 + 3) * 8}
    assert [(p.parameters, p.gradients) for p in plans] == [(local[r % 2],) * 2 for r in range(4)]
    assert [p.optimizer_state for p in plans] == [2 * local[r % 2] + 4 * 4 for r in range(4)]
    # The data axis sums the others: the largest is the second weight's part (9 or 6 elements).
    assert [p.data_axis_buffers for p in plans] == [72, 48, 72, 48]
    # The first layer's unit in backward: its model part whole along data (3 x 8 or 2 x 8), four times over.
    assert [p.data_sharding_buffers for p in plans] == [4 * 192, 4 * 128, 4 * 192, 4 * 128]
    assert "data sharding 768 B" in str(plans[0])


def test_explain_says_how_to_size_the_model_axiss_collectives_until_a_step_is_measured():
    mesh = sg.DeviceMesh((2,), ("model",))
    model = cases.mlp()
    named = [(n, p, tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=False)]
    layouts = resolve_layouts(cases.layout_map(mesh), mesh, named)
    [line] = [d for d in layout_decisions(mesh, layouts) if d.subject == "model axis"]
    assert line.choice == "per step: not measured yet"
    assert "call strategy.memory_plan(example_inputs=one global batch) on every worker" in line.reason
    [line] = [d for d in layout_decisions(mesh, layouts, "all-reduce 1 x 144 B") if d.subject == "model axis"]
    assert line.choice == "per step: all-reduce 1 x 144 B"
    one = sg.DeviceMesh((1, 2), ("model", "data"))  # no model axis to speak of: no line
    assert all(d.subject != "model axis" for d in layout_decisions(one, resolve_layouts(sg.LayoutMap(one), one, named)))
