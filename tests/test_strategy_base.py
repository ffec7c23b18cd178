"""The small `Strategy` base: what `fit`, `evaluate` and the command line read is declared there, with
defaults that hold for one process, so a strategy that implements only the abstract members trains."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cases import assert_same_state, build, make_batches, train_reference
from conftest import cpu_registry
from torch import nn

import stratagem as sg
from stratagem.strategies.explain import Explanation
from stratagem.values import select_replica

pytestmark = pytest.mark.timeout(60)
F64 = torch.float64


class PlainStrategy(sg.Strategy):
    """Only the abstract members: one replica on the CPU, the step function called as it is."""

    def __init__(self) -> None:
        self.runs = 0

    @property
    def local_devices(self) -> list[torch.device]:
        return [torch.device("cpu")]

    def distribute(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self._model = model
        return model if optimizer is None else (model, optimizer)

    def run(self, fn, args=(), kwargs=None):
        self.runs += 1
        return fn(*select_replica(tuple(args), 0), **(kwargs or {}))

    def explain(self) -> Explanation:
        return Explanation(type(self).__name__, 1, [], [], {})


def test_fit_and_evaluate_train_a_strategy_that_implements_only_the_abstract_members():
    batches = make_batches((6,), F64)
    reference, ref_opt, _ = build("mlp", "adam", F64)
    train_reference(reference, ref_opt, batches, epochs=2)
    model, optimizer, _ = build("mlp", "adam", F64)
    strategy = PlainStrategy()
    history = sg.fit(strategy, model, optimizer, F.cross_entropy, batches, epochs=2, clip_grad_norm=1.0)
    assert strategy.runs == 2 * len(batches)
    assert history.model is model and strategy.distributed_model is model
    assert_same_state(reference, history.model, F64)
    evaluation = sg.evaluate(strategy, history.model, batches, F.cross_entropy)
    with torch.no_grad():
        expected = sum(F.cross_entropy(reference(x), y, reduction="sum").item() for x, y in batches) / 37
    assert evaluation.num_examples == 37 and evaluation.loss == pytest.approx(expected, rel=1e-9)


def test_the_defaults_of_the_base_describe_one_process_in_lockstep():
    strategy = sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1))
    data = [1, 2, 3]
    assert strategy.local_devices == [torch.device("cpu")]
    assert strategy.cluster is None and strategy.is_synchronous
    assert strategy.input_pipeline() == (1, 0)
    assert strategy.shard_input(data) is data
    assert strategy.distributed_model is None
    strategy.prepare_fit_steps({"train": lambda x, y: x}, None)  # nothing to learn in one process
    strategy.close()


def test_distributed_model_is_the_model_distribute_returned():
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    try:
        model = strategy.distribute(nn.Linear(3, 2))
        assert strategy.distributed_model is model
        assert strategy.local_devices == [torch.device("cpu")] * 2
        strategy.local_devices.append(torch.device("meta"))  # a copy: the strategy's own list stays as it is
        assert len(strategy.local_devices) == 2
    finally:
        strategy.close()


@pytest.mark.parametrize(
    "make",
    [
        lambda: sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1)),
        lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2)),
        lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2)),
        lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"], share_parameters=False, registry=cpu_registry(2)),
    ],
    ids=["one-device", "mirrored", "central-storage", "central-storage-copies"],
)
def test_each_decision_is_reported_once_by_the_part_that_made_it(make):
    strategy = make()
    try:
        strategy.distribute(nn.Linear(3, 2))  # the replicas part decides where the parameters live now
        subjects = [d.subject for d in strategy.explain().decisions]
        assert len(subjects) == len(set(subjects)), subjects
        assert "devices" in subjects
        if strategy.num_replicas_in_sync > 1:
            assert {"gradient combination", "parameter storage"} <= set(subjects)
            assert "BatchNorm statistics" not in subjects  # a model without BatchNorm has nothing to decide there
    finally:
        strategy.close()
