"""The equivalence promise on the models users run: a tiny GPT-2 and BERT from Hugging Face
configurations and a ResNet-18 with BatchNorm (tests/zoo.py says how each is built and trained).

Every synchronous strategy must give the parameters and buffers of the plain one-device loop on the
same global batches; the parameter server, asynchronous, must train (the loss falls). The loops use
what real scripts use: AdamW with parameter groups, transformers' warm-up schedule stepped inside the
step function, gradient clipping, dict and `BatchEncoding` batches, `outputs.loss`, BatchNorm in
training mode. `test_the_harness_*` run the same loops with SGD, no scheduler and no BatchNorm, so a
failure of the real cases that the simple ones do not share is the strategy's, not the harness's.
"""

from __future__ import annotations

import pytest
import torch
import zoo
from conftest import cpu_registry
from helpers import launch_workers

import stratagem as sg
from stratagem.strategies.parameter_server import ClusterCoordinator, InProcessCluster, ParameterServerStrategy

pytestmark = [pytest.mark.models]

STRATEGIES = {
    "one-device": lambda: sg.OneDeviceStrategy("cpu"),
    "mirrored-2": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(3)),
    "mirrored-3": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3)),
    "central-storage-2": lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(3)),
}


def _replica_states(model) -> list[dict[str, torch.Tensor]]:
    return [r.state_dict() for r in getattr(model, "replicas", [model])]


def _check_strategy(name: str, strategy_name: str, simple: bool) -> None:
    expected, ref_losses = zoo.train_reference(name, simple)
    strategy = STRATEGIES[strategy_name]()
    try:
        model, losses = zoo.train_with(strategy, name, simple)
    finally:
        close = getattr(strategy, "close", None)
        if close is not None:
            close()
    for state in _replica_states(model):  # every replica, not only the one state_dict() shows
        zoo.assert_same_state(name, expected.state_dict(), state)
    # The first step's loss is computed before any update: the same on every strategy, to float rounding.
    assert losses[0] == pytest.approx(ref_losses[0], rel=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy_name", sorted(STRATEGIES))
@pytest.mark.parametrize("name", zoo.MODEL_NAMES)
def test_synchronous_strategies_match_one_device(name, strategy_name):
    _check_strategy(name, strategy_name, simple=False)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy_name", ["mirrored-3"])
@pytest.mark.parametrize("name", zoo.MODEL_NAMES)
def test_the_harness_matches_one_device_with_sgd_and_no_batch_norm(name, strategy_name):
    _check_strategy(name, strategy_name, simple=True)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", zoo.MODEL_NAMES)
def test_two_workers_match_one_device(tmp_path, name, simple=False):
    """One launch per model: 2 worker processes, one replica each; both workers' final states are checked."""
    out = tmp_path / "result.pt"
    exit_code, output = launch_workers(
        "zoo_train.py",
        {"ZOO_MODEL": name, "ZOO_OUT": str(out), "ZOO_TIMEOUT": "60", "ZOO_SIMPLE": "1" if simple else "0"},
        timeout=200,
    )
    assert exit_code == 0, output
    expected, ref_losses = zoo.train_reference(name, simple)
    for rank in range(2):
        saved = torch.load(f"{out}.{rank}")
        zoo.assert_same_state(name, expected.state_dict(), saved["state"])
        assert saved["losses"][0] == pytest.approx(ref_losses[0], rel=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", zoo.MODEL_NAMES)
def test_parameter_server_trains(name):
    """Two workers, asynchronous: no equivalence to ask for, but the loss over a fixed batch must fall."""
    setup = zoo.build(name)
    probe = zoo.make_batches(name, sizes=[8], seed=5)[0]
    batches = zoo.make_batches(name, sizes=[8] * 6, seed=5)  # the same batch again and again: a loss that can fall
    with torch.no_grad():
        setup.model.train()
        before = float(zoo.loss_of(name, setup.model, probe))
    with InProcessCluster(num_workers=2, num_ps=1) as cluster:
        strategy = ParameterServerStrategy(cluster)
        try:
            model, optimizer = strategy.distribute(setup.model, setup.make_optimizer(setup.model))
            coordinator = ClusterCoordinator(strategy)
            step = zoo.make_step(name, model, optimizer, None)  # schedulers on the chief do not reach the servers
            losses = [coordinator.schedule(step, args=(batch,)) for batch in batches]
            coordinator.join()
            assert all(loss.done() for loss in losses)
            model.pull()
        finally:
            strategy.shutdown()
    with torch.no_grad():
        after = float(zoo.loss_of(name, setup.model, probe))
    assert after < before, (before, after)
