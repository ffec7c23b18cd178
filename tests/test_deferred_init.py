"""A model built on meta and each tensor replayed alone equals, bit for bit, the same constructor on one device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stratagem.errors import InputError
from stratagem.strategies.deferred_init import recording


def build() -> nn.Module:
    """Linear, LayerNorm and Embedding's own `reset_parameters`, a model-level `apply(init_fn)`, the initializers
    torch skips on meta (trunc_normal_, orthogonal_), a parameter made from a random tensor, a buffer from
    Python data, a copy from another parameter, a generator of the user's own, and a cast to float64."""
    model = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 16))
    model.register_buffer("scale", torch.tensor([0.5, 2.0]))
    model.offset = nn.Parameter(torch.randn(3, 4) * 0.02)

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            module.bias.data.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(5))

    model.apply(init)
    nn.init.orthogonal_(model[3].weight)
    model[2].weight.data.copy_(model[1].bias.data * 3)
    return model.double()


def test_each_tensor_replayed_alone_is_one_devices_value_and_the_generator_ends_where_it_would():
    torch.manual_seed(3)
    reference = build()
    next_draw = torch.rand(4)
    torch.manual_seed(3)
    with recording() as record:
        model = build()
    assert torch.equal(torch.rand(4), next_draw)  # later draws are the ones one device makes
    expected = dict(reference.state_dict())
    for name, tensor in model.state_dict().items():
        assert tensor.is_meta, name
        assert torch.equal(record.materialize(tensor, name), expected[name]), name


def test_materialize_leaves_the_generator_as_it_was():
    with recording() as record:
        layer = nn.Linear(5, 3)
    torch.manual_seed(9)
    record.materialize(layer.weight)
    after = torch.rand(3)
    torch.manual_seed(9)
    assert torch.equal(torch.rand(3), after)


def test_a_value_read_from_a_tensor_not_built_yet_is_refused_by_name():
    with pytest.raises(InputError, match=r"cannot be read from one. Received: \.item\(\)"):
        with recording():
            layer = nn.Linear(4, 4)
            if layer.weight.abs().max() > 1:  # a constructor that looks at its own values
                pass


def test_a_draw_with_tensors_as_its_parameters_is_refused_by_name():
    with pytest.raises(InputError, match=r"aten.normal.Tensor_float draws random numbers whose parameters"):
        with recording():
            torch.normal(torch.zeros(3), 1.0)


def test_an_operation_writing_two_recorded_tensors_is_refused_when_either_is_asked_for():
    with recording() as record:
        a, b = torch.zeros(3), torch.zeros(3)
        torch._foreach_add_([a, b], 1.0)
    with pytest.raises(InputError, match=r"The value of 'a' cannot be replayed one tensor at a time: .*_foreach_add"):
        record.materialize(a, "'a'")


def test_a_meta_tensor_made_outside_the_record_is_refused_when_asked_for():
    outside = torch.empty(2, device="meta")
    with recording() as record:
        inside = outside + 1
    with pytest.raises(InputError, match=r"a meta tensor made where strategy.scope\(\) could not see it"):
        record.materialize(inside, "'inside'")
