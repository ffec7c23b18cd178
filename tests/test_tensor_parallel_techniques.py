"""TensorParallelStrategy's techniques: applied in the table's order, each only where the mesh has its axes."""

from __future__ import annotations

import subprocess
import sys

import pytest
from torch import nn

import stratagem as sg
from stratagem.strategies.records import STRATEGIES
from stratagem.strategies.tensor_parallel.data_sharding import sharding_units
from stratagem.strategies.tensor_parallel.mesh import resolve_layouts
from stratagem.strategies.tensor_parallel.techniques import (
    TECHNIQUES,
    Placing,
    Technique,
    apply_techniques,
    check_techniques,
    techniques_decision,
)


def _placing(mesh: sg.DeviceMesh, model: nn.Module, layout_map: sg.LayoutMap | None = None) -> Placing:
    named = [(n, p, tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=False)]
    layouts = resolve_layouts(layout_map or sg.LayoutMap(mesh), mesh, named)
    return Placing(model=model, mesh=mesh, torch_mesh=None, layouts=layouts, weight=lambda: 1.0)


def test_the_techniques_run_in_the_tables_order_and_skip_an_axis_the_mesh_lacks():
    calls: list[str] = []
    table = [Technique(name=t.name, axes=t.axes, apply=lambda placing, n=t.name: calls.append(n)) for t in TECHNIQUES]
    apply_techniques(_placing(sg.DeviceMesh((2, 2), ("data", "model")), nn.Linear(2, 2)), table)
    assert calls == ["tensor parallel", "data sharding", "replication"]
    calls.clear()
    apply_techniques(_placing(sg.DeviceMesh((2,), ("model",)), nn.Linear(2, 2)), table)
    assert calls == ["tensor parallel"]


def test_the_strategys_record_lists_this_table_in_order() -> None:
    listed = [(t.name, t.axes) for t in STRATEGIES["tensor_parallel"].techniques]
    assert listed == [("tensor parallel", ("model",)), ("data sharding", ("data",)), ("replication", ("data",))]
    assert STRATEGIES["tensor_parallel"].techniques == TECHNIQUES


def test_each_parameter_as_built_maps_to_the_one_that_replaced_it_tied_ones_under_each_name():
    model = nn.Sequential(nn.Embedding(3, 2), nn.Linear(2, 3, bias=False))
    model[1].weight = model[0].weight  # tied, as GPT-2's wte and lm_head
    old = model[0].weight
    replacement = nn.Parameter(old.detach().clone())

    def replace(placing: Placing) -> None:
        placing.model[0].weight = replacement
        placing.model[1].weight = replacement

    made = apply_techniques(
        _placing(sg.DeviceMesh((2,), ("model",)), model),
        [Technique(name="replace", axes=("model",), apply=replace)],
    )
    assert made == {id(old): replacement}


def test_explain_names_the_techniques_in_order_with_the_parameters_sharded_along_data():
    mesh = sg.DeviceMesh((2, 2), ("data", "model"))
    layout_map = sg.LayoutMap(mesh)
    layout_map["weight"] = ("data", None)
    model = nn.Linear(2, 2)
    named = [(n, p, tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=False)]
    decision = techniques_decision(mesh, resolve_layouts(layout_map, mesh, named))
    assert decision.subject == "techniques"
    assert decision.choice == (
        "tensor parallel on model, then data sharding on data (1 parameter(s)), then replication on data "
        "(every other parameter)"
    )
    assert techniques_decision(sg.DeviceMesh((2,), ("model",)), []).choice == "tensor parallel on model"


def test_distribute_runs_each_techniques_check_so_data_shardings_refusal_comes_before_anything_is_placed():
    mesh = sg.DeviceMesh((2, 2), ("data", "model"))
    layout_map = sg.LayoutMap(mesh)
    layout_map["weight"] = (None, "data")  # 3 input features over 2 data workers: FSDP2 pads dimension 0 only
    with pytest.raises(sg.InputError, match=r"Sharding weight along 'data' splits its dimension 1 \(size 3\)"):
        check_techniques(_placing(mesh, nn.Linear(3, 2), layout_map))


def test_the_units_sharded_along_data_come_innermost_first_then_by_name_the_root_last():
    mesh = sg.DeviceMesh((2, 2), ("data", "model"))
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 2))
    model[2].weight = model[0].weight  # tied: the root's unit
    layout_map = sg.LayoutMap(mesh)
    layout_map[r"weight$"] = ("data", None)
    named = [(n, p, tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=False)]
    layouts = resolve_layouts(layout_map, mesh, named)
    # On every worker alike, whatever order its string hashing gives a set of the names.
    assert sharding_units(layouts) == sharding_units(list(reversed(layouts))) == ["1.0", "1.1", ""]


def test_importing_the_strategy_leaves_fsdp2_unimported_until_a_layout_names_data():
    code = "import sys, stratagem.strategies.tensor_parallel.strategy; print('torch.distributed.fsdp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"  # data_sharding.py imports FSDP2 (over a second of CPU) when it shards
