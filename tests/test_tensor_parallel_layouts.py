"""DeviceMesh and LayoutMap: Keras 3's meaning, and every refusal, with no process group."""

from __future__ import annotations

import pytest
from torch import nn

import stratagem as sg
from stratagem.strategies.tensor_parallel.mesh import default_mesh, resolve_layouts


def _params(model: nn.Module):
    return [(name, p, tuple(p.shape)) for name, p in model.named_parameters(remove_duplicate=False)]


def test_keys_are_regular_expressions_searched_in_order_and_an_exact_key_wins():
    layout_map = sg.LayoutMap(sg.DeviceMesh((2,), ("model",)))
    layout_map[r"dense.*kernel"] = (None, "model")
    layout_map[r"dense_1\.kernel"] = ("model", None)  # later: an exact name wins, else first match
    layout_map["dense_2.kernel"] = ("model", None)
    assert layout_map["dense_1.kernel"] == (None, "model")
    assert layout_map["my/dense_3/kernel"] == (None, "model")
    assert layout_map["dense_2.kernel"] == ("model", None)
    assert layout_map["conv.bias"] is None
    assert list(layout_map) == [r"dense.*kernel", r"dense_1\.kernel", "dense_2.kernel"]


def test_a_mesh_knows_its_size_and_axes():
    mesh = sg.DeviceMesh((2, 3), ("data", "model"))
    assert (mesh.size, mesh.axis_size("data"), mesh.axis_size("model"), mesh.axis_size("other")) == (6, 2, 3, 1)
    assert default_mesh(3) == sg.DeviceMesh((3,), ("model",))
    mesh.check_workers(6)


def test_a_mesh_whose_product_is_not_the_worker_count_is_refused_naming_both():
    with pytest.raises(sg.InputError, match=r"spans 4 workers but the job has 3.*shape=\(2, 2\).*workers=3"):
        sg.DeviceMesh((2, 2), ("data", "model")).check_workers(3)


@pytest.mark.parametrize(
    ("shape", "names", "message"),
    [
        ((2, 2), ("model", "model"), r"axis names must differ.*\('model', 'model'\)"),
        ((2, 2), ("model",), r"names each of its axes.*axis_names=\('model',\)"),
        ((0,), ("model",), r"positive whole number.*shape=\(0,\)"),
        ((2.0,), ("model",), r"positive whole number"),
    ],
)
def test_a_malformed_mesh_is_refused_with_its_values(shape, names, message):
    with pytest.raises(sg.InputError, match=message):
        sg.DeviceMesh(shape, names)


def test_a_layout_naming_an_axis_not_in_the_mesh_is_refused():
    layout_map = sg.LayoutMap(sg.DeviceMesh((2,), ("model",)))
    with pytest.raises(
        sg.InputError, match=r"names axis 'data', which the mesh does not have.*Use one of \('model',\)"
    ):
        layout_map["fc.weight"] = ("data", None)
    # Without a mesh, checked when the strategy resolves it against its own (the default: one 'model' axis).
    unbound = sg.LayoutMap()
    unbound["weight"] = ("data", None)
    with pytest.raises(sg.InputError, match=r"names axis 'data'"):
        resolve_layouts(unbound, default_mesh(2), _params(nn.Linear(3, 4)))


@pytest.mark.parametrize(
    ("layout", "message"),
    [(("model", "model"), "at most once"), ("model", "one mesh axis name or None"), ((0, None), "one mesh axis")],
)
def test_a_malformed_layout_is_refused(layout, message):
    with pytest.raises(sg.InputError, match=message):
        sg.LayoutMap(sg.DeviceMesh((2,), ("model",)))["w"] = layout


def test_a_key_that_is_not_a_regular_expression_is_refused():
    with pytest.raises(sg.InputError, match=r"not a regular expression. Received: 'fc\('"):
        sg.LayoutMap()["fc("] = ("model",)


def test_a_layout_whose_length_is_not_the_tensors_dimensions_is_refused():
    layout_map = sg.LayoutMap(sg.DeviceMesh((2,), ("model",)))
    layout_map[r"weight"] = ("model",)
    with pytest.raises(sg.InputError, match=r"weight has 1 entries but the parameter has 2 dimensions.*shape \(4, 3\)"):
        resolve_layouts(layout_map, layout_map.mesh, _params(nn.Linear(3, 4)))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 3)
        self.head = nn.Linear(3, 7, bias=False)
        self.head.weight = self.embed.weight


def test_tied_parameters_given_different_layouts_are_refused_naming_both():
    layout_map = sg.LayoutMap(sg.DeviceMesh((2,), ("model",)))
    layout_map[r"embed\.weight"] = ("model", None)
    layout_map[r"head\.weight"] = (None, "model")
    with pytest.raises(sg.InputError, match=r"embed.weight and head.weight are one tied parameter.*Give both the same"):
        resolve_layouts(layout_map, layout_map.mesh, _params(Tied()))


def test_a_tied_name_no_key_matches_follows_the_matched_one_and_unmatched_parameters_are_replicated():
    layout_map = sg.LayoutMap(sg.DeviceMesh((2,), ("model",)))
    layout_map[r"embed\.weight"] = ("model", None)
    model = nn.Sequential(Tied(), nn.LayerNorm(3))
    resolved = {r.names: (r.layout, r.key) for r in resolve_layouts(layout_map, layout_map.mesh, _params(model))}
    assert resolved == {
        ("0.embed.weight", "0.head.weight"): (("model", None), r"embed\.weight"),
        ("1.weight",): ((None,), None),
        ("1.bias",): ((None,), None),
    }
