"""Losses averaged over tokens, not examples: with each replica's token count declared by
sg.set_loss_weight, every strategy gives one device's update and `reduce("mean")` one device's loss."""

from __future__ import annotations

import pytest
import torch
from helpers import launch_workers
from in_process_strategies import STRATEGIES
from loss_weight_cases import train

import stratagem as sg

TOL = dict(rtol=1e-9, atol=1e-12)


def _assert_state(got, expected):
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, **TOL, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("way", ["mean", "sum"])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_token_mean_loss_with_declared_counts_matches_one_device(name, way):
    expected, expected_losses = train(None)
    strategy = STRATEGIES[name]()
    got, losses = train(strategy, way)
    _assert_state(got, expected)
    assert losses == pytest.approx(expected_losses, rel=1e-9)
    strategy.close()


def test_without_declared_counts_a_token_mean_is_weighted_by_examples_and_drifts():
    expected, _ = train(None)
    strategy = STRATEGIES["mirrored-3"]()
    got, _ = train(strategy, "undeclared")
    worst = max(((got[k] - v).abs().max() / v.abs().max()).item() for k, v in expected.items())
    assert worst > 1e-3  # what the declaration fixes: this data makes the difference visible
    strategy.close()


def test_every_replica_or_none_declares_a_weight():
    strategy = STRATEGIES["mirrored-2"]()
    model = strategy.distribute(torch.nn.Linear(2, 1))
    (x,) = list(strategy.distribute_dataset([torch.ones(4, 2)]))

    def step(x):
        if sg.current_replica_context().replica_id_in_sync_group == 0:
            sg.set_loss_weight(3)
        model(x).sum().backward()

    with pytest.raises(sg.InputError, match=r"1 of 2 replicas declared a loss weight .* on every replica"):
        strategy.run(step, args=(x,))
    strategy.close()


@pytest.mark.parametrize("bad", [-1, float("nan"), "3", torch.tensor(-2.0)])
def test_set_loss_weight_refuses_what_is_not_a_count(bad):
    strategy = STRATEGIES["mirrored-2"]()
    with pytest.raises(sg.InputError, match=r"A loss weight is the number of units .* Received: count="):
        strategy.run(lambda: sg.set_loss_weight(bad))
    strategy.close()


def test_set_loss_weight_outside_run_is_refused():
    with pytest.raises(sg.InputError, match=r"inside the function given to strategy.run\(\). Received: a call outside"):
        sg.set_loss_weight(3)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_workers_combine_by_declared_counts(tmp_path):
    out = tmp_path / "result.pt"
    exit_code, output = launch_workers("mwms_loss_weights.py", {"MW_OUT": str(out)}, timeout=280)
    assert exit_code == 0, output
    saved = torch.load(out)
    expected, expected_losses = train(None)
    for key in [(1, "mean"), (2, "mean"), (1, "sum"), (2, "sum")]:
        state, losses = saved[key]
        _assert_state(state, expected)
        assert losses == pytest.approx(expected_losses, rel=1e-9), key
