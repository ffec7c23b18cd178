"""`torch.save(model)`, `pickle.dumps(model)` and `copy.deepcopy(model)` of a distributed model give what they
give on one device: the plain model, of the user's class, with the trained values (issue 27, item 3).

Before, under Mirrored x2 they failed with "cannot pickle '_thread.RLock' object" (the replicas' threads and
locks travelled with the model)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from cases import build, make_batches, train_reference, train_with
from in_process_strategies import STRATEGIES
from torch import nn

import stratagem as sg


def _trained(name: str) -> tuple[nn.Module, nn.Module, sg.Strategy]:
    """The plain model trained on one device, and the same model trained under strategy `name`."""
    batches = make_batches((6,), torch.float64)
    reference, opt, _ = build("mlp", "adam", torch.float64)
    train_reference(reference, opt, batches)
    model, opt, _ = build("mlp", "adam", torch.float64)
    strategy = STRATEGIES[name]()
    distributed, _, _ = train_with(strategy, model, opt, batches)
    return reference, distributed, strategy


def _round_trips(model: nn.Module) -> dict[str, nn.Module]:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return {
        "pickle": pickle.loads(pickle.dumps(model)),
        "deepcopy": copy.deepcopy(model),
        "torch.save": torch.load(buffer, weights_only=False),
    }


@pytest.mark.parametrize("name", ["one-device", "mirrored-2", "mirrored-3-copies", "central-3"])
def test_a_distributed_model_pickles_as_the_plain_model_with_its_trained_values(name):
    reference, distributed, strategy = _trained(name)
    try:
        for how, plain in _round_trips(distributed).items():
            assert type(plain) is nn.Sequential, how  # the user's class, not a wrapper of replicas
            assert plain.state_dict().keys() == reference.state_dict().keys(), how
            for key, value in reference.state_dict().items():
                torch.testing.assert_close(plain.state_dict()[key], value, rtol=1e-9, atol=1e-12, msg=how)
            x = torch.randn(5, 6, dtype=torch.float64)
            torch.testing.assert_close(plain(x), reference(x), rtol=1e-9, atol=1e-12, msg=how)
    finally:
        strategy.close()


def test_a_deep_copy_is_independent_of_the_distributed_model():
    _, distributed, strategy = _trained("mirrored-2")
    try:
        copied = copy.deepcopy(distributed)
        before = [p.detach().clone() for p in distributed.parameters()]
        with torch.no_grad():
            for p in copied.parameters():
                p.add_(1.0)
        for p, q in zip(distributed.parameters(), before):
            assert torch.equal(p, q)
    finally:
        strategy.close()
