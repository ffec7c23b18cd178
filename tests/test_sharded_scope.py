"""`strategy.scope()`: under ShardedStrategy a model built inside is sharded as it is built, with one device's values;
under the other strategies the model is built as usual."""

from __future__ import annotations

import pytest
import sharded_scope_cases
import torch
from helpers import free_port, run_ranks
from in_process_strategies import STRATEGIES
from torch import nn

pytestmark = [pytest.mark.sharded]


@pytest.mark.timeout(240)
def test_a_model_built_inside_the_scope_is_sharded_with_one_devices_values_bit_for_bit():
    outcomes = run_ranks(sharded_scope_cases.scope_cases, [0, 1], args=((free_port(), free_port()),), timeout=220)
    errors = {rank: outcome.error for rank, outcome in outcomes.items() if outcome.error is not None}
    assert not errors, errors
    for rank, outcome in outcomes.items():
        got = outcome.value
        assert got["sequential differing"] == [], (rank, got["sequential differing"])
        assert set(got["sequential sharded"]) == {"DTensor"}
        # Embedding(13, 6), Linear(6, 17) weight and bias, LayerNorm(17) twice, Linear(17, 5) weight and bias.
        assert got["sequential local rows"] == [[7, 9, 9, 9, 9, 3, 3], [6, 8, 8, 8, 8, 2, 2]][rank]
        assert got["draw after the scope"] and got["gpt2 draw after the scope"]
        assert got["sequential trained"] <= 1e-9, (rank, got["sequential trained"])
        assert got["gpt2 differing"] == [], (rank, got["gpt2 differing"])
        assert got["gpt2 tied"]
        assert got["gpt2 again differing"] == [], (rank, got["gpt2 again differing"])
        assert "a value cannot be read from one. Received: .item()" in got["refused item"]
        assert "aten.bernoulli_.Tensor on a sharded parameter draws with tensors" in got["refused sharded draw"]
        assert "Received: BatchNorm layers ['1']" in got["refused batch norm"]


@pytest.mark.parametrize("name", ["one-device", "mirrored-2"])
def test_under_the_data_parallel_strategies_the_scope_builds_the_model_as_usual(name):
    strategy = STRATEGIES[name]()
    try:
        torch.manual_seed(4)
        reference = nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5))
        torch.manual_seed(4)
        with strategy.scope():
            model = nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5))
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
        assert not any(p.is_meta for p in model.parameters())
        model, _ = strategy.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
    finally:
        strategy.close()
