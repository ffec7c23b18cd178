"""sg.fit under ParameterServerStrategy: fit's own steps scheduled on the workers, evaluation inline.

With one worker the steps run one after another, so the asynchronous strategy must give exactly the
parameters of a plain one-device loop; with two it must still learn.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from cases import TOL, build, make_batches, train_reference

import stratagem as sg
from stratagem.errors import InputError
from stratagem.strategies.parameter_server import (
    FixedShardsPartitioner,
    InProcessCluster,
    ParameterServerStrategy,
)


def _plain_mean_loss(model, batches):
    with torch.no_grad():
        total = sum(F.cross_entropy(model(x), y, reduction="sum").item() for x, y in batches)
    return total / sum(len(y) for _, y in batches)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam"])
def test_fit_with_one_worker_equals_the_plain_loop(opt_name):
    model, optimizer, shape = build("mlp", opt_name, torch.float64)
    reference = copy.deepcopy(model)
    ref_opt = type(optimizer)(reference.parameters(), **optimizer.defaults)
    batches = make_batches(shape, torch.float64)
    train_reference(reference, ref_opt, batches + batches)
    with InProcessCluster(num_workers=1, num_ps=2) as cluster:
        strategy = ParameterServerStrategy(cluster, partitioner=FixedShardsPartitioner(2))
        try:
            history = sg.fit(
                strategy,
                model,
                optimizer,
                F.cross_entropy,
                batches,
                epochs=2,
                metrics=["accuracy"],
                clip_grad_norm=1.0,
                validation_data=batches,
            )
            # After fit, the chief's copy holds the trained values (pulled from the parameter servers).
            for (name, got), want in zip(history.model.module.named_parameters(), reference.parameters()):
                torch.testing.assert_close(got, want, **TOL[torch.float64], msg=lambda m, n=name: f"{n}: {m}")
            # Validation ran on the worker after each epoch; after the last, on the trained parameters.
            assert [log.num_examples for log in history.epochs] == [37, 37]
            assert history.history["val_loss"][-1] == pytest.approx(_plain_mean_loss(reference, batches), rel=1e-9)
            # sg.evaluate after fit runs inline on the chief, on the same parameters.
            inline = sg.evaluate(strategy, history.model, batches, F.cross_entropy)
            assert inline.loss == pytest.approx(history.history["val_loss"][-1], rel=1e-9)
        finally:
            strategy.close()


@pytest.mark.timeout(90)
def test_fit_with_two_workers_learns():
    model, optimizer, shape = build("mlp", "adam", torch.float32)
    batches = make_batches(shape, torch.float32, sizes=[16] * 12, seed=3)
    # A learnable target: the class is the index of the largest of the first four features.
    batches = [(x, x[:, :4].argmax(dim=1)) for x, _ in batches]
    with InProcessCluster(num_workers=2, num_ps=1) as cluster:
        strategy = ParameterServerStrategy(cluster)
        try:
            history = sg.fit(strategy, model, optimizer, F.cross_entropy, batches, epochs=6, metrics=["accuracy"])
        finally:
            strategy.close()
    losses = history.history["loss"]
    assert [log.num_examples for log in history.epochs] == [192] * 6  # every step ran exactly once
    assert losses[-1] < 0.6 * losses[0], losses
    assert history.trace is None  # fit's default trace leaves it out: it records full spans only (docs/trace.md)


@pytest.mark.timeout(60)
def test_a_step_that_trains_outside_a_scheduled_function_is_refused_with_the_fix():
    model, optimizer, shape = build("mlp", "sgd_momentum", torch.float64)
    with InProcessCluster(num_workers=1, num_ps=1) as cluster:
        strategy = ParameterServerStrategy(cluster)
        try:
            ps_model, ps_optimizer = strategy.distribute(model, optimizer)

            def step(x, y):  # not one of fit's steps: it runs inline on the chief, where step() cannot push
                F.cross_entropy(ps_model(x), y).backward()
                ps_optimizer.step()
                return torch.zeros(3)

            with pytest.raises(InputError, match="scheduled function"):
                strategy.run_fit_steps(step, make_batches(shape, torch.float64, sizes=[4]), lambda state: None)
        finally:
            strategy.close()
