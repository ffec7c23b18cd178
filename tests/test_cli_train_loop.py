"""The pieces behind `stratagem train`: digits data, model, exact metrics through fit and evaluate,
config and strategy choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_registry
from torch import nn

import stratagem as sg
from stratagem.demo import TrainConfig, build_digits_model, load_digits_data, make_loader
from stratagem.strategies.by_name import build_strategy
from stratagem.train import Callback, evaluate, fit

pytestmark = pytest.mark.timeout(120)


def test_digits_split_is_fixed_and_scaled():
    data = load_digits_data()
    assert data.train_x.shape == (1437, 1, 8, 8) and data.test_x.shape == (360, 1, 8, 8)
    assert data.train_x.dtype == torch.float32 and data.train_y.dtype == torch.int64
    assert float(data.train_x.min()) == 0.0 and float(data.train_x.max()) == 1.0
    # Stratified: all ten classes in the test split, 35 to 37 images each (1797 / 10 / 5).
    counts = torch.bincount(data.test_y, minlength=10)
    assert int(counts.min()) >= 35 and int(counts.max()) <= 37
    assert torch.equal(load_digits_data().test_y, data.test_y)


def test_bad_test_fraction_is_refused():
    with pytest.raises(sg.InputError, match=r"strictly between 0 and 1. Received: test_fraction=1.5"):
        load_digits_data(test_fraction=1.5)


def test_model_weights_depend_only_on_the_seed_and_leave_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a, b, c = build_digits_model(7), build_digits_model(7), build_digits_model(8)
    assert torch.equal(torch.rand(3), expected_next)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(next(a.parameters()), next(c.parameters()))
    assert a(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


def test_make_loader_refuses_a_bad_batch_size():
    with pytest.raises(sg.InputError, match=r"positive integer. Received: batch_size=0"):
        make_loader(torch.zeros(4, 1), torch.zeros(4), 0, shuffle=False)


def test_evaluate_counts_correct_over_the_global_batch_not_per_replica():
    # The model returns its input as logits, so the predictions are the argmax of each row, set by hand.
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3))
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [0.0, 1.0]])
    labels = torch.tensor([0, 0, 1, 1, 1, 0, 1])
    # Batch 1 (5 examples) splits 2, 2, 1: replica accuracies 1/2, 0/2, 1/1, whose mean would be 0.5.
    # Batch 2 (2 examples) splits 1, 1, 0: replica 2 has an empty slice and must count for nothing.
    batches = [(logits[:5], labels[:5]), (logits[5:], labels[5:])]
    try:
        result = evaluate(strategy, nn.Identity(), batches, F.cross_entropy, metrics=["accuracy"])
    finally:
        strategy.close()
    assert result.num_examples == 7
    assert result["accuracy"] == pytest.approx(4 / 7)  # rows 0, 4, 5, 6 are right
    assert result["loss"] == pytest.approx(float(F.cross_entropy(logits, labels)), rel=1e-6)


class StepRecorder(Callback):
    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []

    def on_train_batch_end(self, context, num_examples):
        self.steps.append((num_examples, context.step))


def test_fit_on_digits_reports_each_step_and_matches_one_device():
    data = load_digits_data()
    x, y = data.train_x[:23], data.train_y[:23]
    results, recorder = [], StepRecorder()
    for devices in (["cpu:0"], ["cpu:0", "cpu:1", "cpu:2"]):
        strategy = sg.MirroredStrategy(devices, registry=cpu_registry(3))
        net = build_digits_model(0)
        try:
            callbacks = [recorder] if len(devices) == 3 else []
            results.append(
                fit(
                    strategy,
                    net,
                    torch.optim.Adam(net.parameters(), lr=1e-3),
                    F.cross_entropy,
                    make_loader(x, y, 10, shuffle=False),
                    metrics=["accuracy"],
                    callbacks=callbacks,
                )
            )
        finally:
            strategy.close()
    one, three = (r.epochs[0] for r in results)
    assert recorder.steps == [(10, 1), (10, 2), (3, 3)]
    assert (one.epoch, one.num_examples, three.num_examples) == (1, 23, 23)
    assert three.metrics["loss"] == pytest.approx(one.metrics["loss"], rel=1e-5)
    assert three.metrics["accuracy"] == one.metrics["accuracy"]


def test_an_empty_loader_is_an_error():
    strategy = sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1))
    with pytest.raises(sg.InputError, match="The evaluation data yielded no examples"):
        evaluate(strategy, nn.Identity(), [], F.cross_entropy)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"epochs": 0}, r"epochs must be a positive integer. Received: epochs=0"),
        ({"batch_size": 2.5}, r"batch_size must be a positive integer. Received: batch_size=2.5"),
        ({"lr": float("nan")}, r"lr must be a positive finite number. Received: lr=nan"),
        ({"strategy": "sync_sgd"}, r"Received: strategy='sync_sgd'. Choose one of mirrored, one_device"),
    ],
)
def test_train_config_refuses_bad_values(kwargs, message):
    with pytest.raises(sg.InputError, match=message):
        TrainConfig(**kwargs)


def test_default_cpu_devices_are_two_logical_replicas_at_most():
    strategy, decision = build_strategy("mirrored", registry=cpu_registry(3))
    strategy.close()
    assert [r.device for r in strategy.explain().replicas] == ["cpu:0", "cpu:1"]
    assert decision.choice == "cpu:0, cpu:1"
    assert "2 logical CPU replica(s) out of the 3" in decision.reason and "--devices" in decision.reason
    strategy, decision = build_strategy("mirrored", registry=cpu_registry(1))
    assert strategy.num_replicas_in_sync == 1 and decision.choice == "cpu:0"
    strategy, decision = build_strategy("one_device", registry=cpu_registry(3))
    assert strategy.num_replicas_in_sync == 1 and decision.choice == "cpu:0"


def test_build_strategy_refuses_unknown_names_and_several_devices_for_one_device():
    with pytest.raises(sg.InputError, match=r"Received: 'sync_sgd'. Choose one of mirrored, one_device, multi_worker"):
        build_strategy("sync_sgd", registry=cpu_registry(2))
    with pytest.raises(sg.DeviceError, match=r"exactly one device. Received: devices=\['cpu:0', 'cpu:1'\]"):
        build_strategy("one_device", ["cpu:0", "cpu:1"], registry=cpu_registry(2))
