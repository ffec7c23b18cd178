"""What TensorParallelStrategy refuses before any process group exists, or before any parameter is placed."""

from __future__ import annotations

import pytest
import tensor_parallel_cases
from torch import nn

import stratagem as sg
from stratagem.strategies.tensor_parallel.data_sharding import check_data_sharding
from stratagem.strategies.tensor_parallel.mesh import resolve_layouts
from stratagem.strategies.tensor_parallel.styles import check_splits


def _check(model: nn.Module, layout_map: sg.LayoutMap) -> dict[str, str]:
    named = [(n, p, tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=False)]
    return check_splits(model, resolve_layouts(layout_map, layout_map.mesh, named), layout_map.mesh)


def test_gpt2s_layout_is_honoured_and_each_split_gets_its_modules_kind():
    kinds = _check(tensor_parallel_cases.gpt2(), tensor_parallel_cases.layout_map(sg.DeviceMesh((3,), ("model",))))
    assert kinds["transformer.wte.weight"] == "Embedding"
    assert kinds["transformer.h.0.attn.c_attn.weight"] == "Conv1D"


def test_a_split_that_cuts_attention_heads_in_two_is_refused_naming_the_module():
    layouts = tensor_parallel_cases.layout_map(sg.DeviceMesh((3,), ("model",)))
    with pytest.raises(sg.InputError, match=r"attention module transformer.h.0.attn has 2 heads, which 3 workers"):
        _check(tensor_parallel_cases.gpt2(heads=2), layouts)


def test_a_fused_attention_kernel_is_refused_with_the_eager_fix():
    layouts = tensor_parallel_cases.layout_map(sg.DeviceMesh((2,), ("model",)))
    with pytest.raises(sg.InputError, match=r"attn_implementation='sdpa'.*Build it with attn_implementation='eager'"):
        _check(tensor_parallel_cases.gpt2(attention="sdpa"), layouts)


def test_a_split_of_a_module_not_supported_yet_is_refused_naming_it():
    layouts = sg.LayoutMap(sg.DeviceMesh((2,), ("model",)))
    layouts[r"1\.weight"] = ("model",)
    with pytest.raises(sg.InputError, match=r"Splitting 1.weight is not supported yet: its module 1 is a LayerNorm"):
        _check(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), layouts)


def test_an_embedding_that_renormalises_its_rows_is_refused():
    layouts = sg.LayoutMap(sg.DeviceMesh((2,), ("model",)))
    layouts["weight"] = ("model", None)
    with pytest.raises(sg.InputError, match=r"renormalises its rows in place \(max_norm\)"):
        _check(nn.Embedding(5, 3, max_norm=1.0), layouts)


def test_a_mesh_that_is_not_the_worker_count_is_refused_before_any_process_group():
    cluster = {
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]},
        "task": {"type": "worker", "index": 0},
    }
    layouts = sg.LayoutMap(sg.DeviceMesh((2, 2), ("data", "model")))
    with pytest.raises(sg.InputError, match=r"spans 4 workers but the job has 3"):
        sg.TensorParallelStrategy(layouts, cluster=cluster)


def test_a_mesh_axis_other_than_data_and_model_is_refused():
    cluster = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}
    with pytest.raises(sg.InputError, match=r"other axes are not supported yet.*\('pipe',\)"):
        sg.TensorParallelStrategy(sg.LayoutMap(sg.DeviceMesh((2,), ("pipe",))), cluster=cluster)


@pytest.mark.parametrize("name", ["sharded", "model_parallel"])
def test_the_sharded_and_pipeline_strategies_refuse_a_layout_map_by_name(name):
    with pytest.raises(sg.InputError, match=rf"{name} with a layout map is not supported yet"):
        sg.strategy_from_env({"STRATAGEM_STRATEGY": name}, layout_map=sg.LayoutMap())


def test_a_split_along_data_is_honoured_by_any_module_since_it_is_gathered_whole_first():
    layouts = sg.LayoutMap(sg.DeviceMesh((2, 2), ("data", "model")))
    layouts[r"1\.weight"] = ("data",)
    assert _check(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), layouts) == {}


def test_a_split_along_data_of_an_uneven_dimension_other_than_the_first_is_refused_with_the_fix():
    mesh = sg.DeviceMesh((2, 2), ("data", "model"))
    layouts = sg.LayoutMap(mesh)
    layouts["weight"] = ("model", "data")
    model = nn.Linear(5, 4)
    named = [(n, p, tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=False)]
    with pytest.raises(
        sg.InputError,
        match=r"Sharding weight along 'data' splits its dimension 1 \(size 5\), which 2 data workers cannot split "
        r"evenly.*Put 'data' on dimension 0, or on a dimension whose size 2 divides",
    ):
        check_data_sharding(resolve_layouts(layouts, mesh, named), mesh)


def test_an_uneven_split_along_data_of_the_first_dimension_is_taken():
    mesh = sg.DeviceMesh((2, 2), ("data", "model"))
    layouts = sg.LayoutMap(mesh)
    layouts["weight"] = ("data", "model")
    model = nn.Linear(4, 5)  # 5 rows over 2 data workers: 3 and 2, as FSDP2 cuts them
    named = [(n, p, tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=False)]
    check_data_sharding(resolve_layouts(layouts, mesh, named), mesh)


def test_a_layout_naming_data_on_a_mesh_of_one_model_axis_is_refused():
    layouts = sg.LayoutMap(sg.DeviceMesh((2,), ("model",)))
    with pytest.raises(sg.InputError, match=r"names axis 'data', which the mesh does not have"):
        layouts["weight"] = ("data", None)
