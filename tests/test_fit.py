"""`fit`: the same parameters as a plain one-device loop under every replica count, exact metrics over
uneven splits, validation, callbacks, the strategy extension point, and errors before any work."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from cases import assert_same_state, build, make_batches, train_reference
from conftest import cpu_registry
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from stratagem.train import Callback, ProgressBar

pytestmark = pytest.mark.timeout(60)
F64 = torch.float64


def make_strategy(num_replicas: int) -> sg.Strategy:
    if num_replicas == 1:
        return sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1))
    return sg.MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)], registry=cpu_registry(num_replicas))


def reference_losses(model: nn.Module, optimizer: torch.optim.Optimizer, batches) -> list[tuple[float, int, int]]:
    """Runs the plain loop of tests/cases.py, recording (loss sum, correct, examples) of each batch
    from the outputs its forward pass produced (before that batch's update)."""
    outputs: list[torch.Tensor] = []
    handle = model.register_forward_hook(lambda _m, _i, out: outputs.append(out.detach()))
    try:
        train_reference(model, optimizer, batches)
    finally:
        handle.remove()
    records = []
    for out, (_, y) in zip(outputs, batches):
        records.append((float(F.cross_entropy(out, y, reduction="sum")), int((out.argmax(1) == y).sum()), len(y)))
    return records


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_fit_matches_a_plain_loop_and_reports_exact_epoch_metrics(num_replicas):
    batches = make_batches((6,), F64)  # 12, 11, 7, 2, 5 examples: uneven splits, one smaller than 3 replicas
    reference, ref_opt, _ = build("mlp", "sgd_momentum", F64)
    records = reference_losses(reference, ref_opt, batches + batches)
    model, optimizer, _ = build("mlp", "sgd_momentum", F64)
    strategy = make_strategy(num_replicas)
    try:
        history = sg.fit(
            strategy, model, optimizer, F.cross_entropy, batches, epochs=2, metrics=["accuracy"], clip_grad_norm=1.0
        )
    finally:
        strategy.close()
    assert_same_state(reference, history.model, F64)
    per_epoch = [records[:5], records[5:]]
    for log, epoch_records in zip(history.epochs, per_epoch):
        examples = sum(r[2] for r in epoch_records)
        assert log.num_examples == examples == 37
        assert log.metrics["loss"] == pytest.approx(sum(r[0] for r in epoch_records) / examples, rel=1e-9)
        assert log.metrics["accuracy"] == sum(r[1] for r in epoch_records) / examples
    assert [log.epoch for log in history.epochs] == [1, 2]
    assert history.history["loss"] == [log.metrics["loss"] for log in history.epochs]


def _identity_linear() -> nn.Linear:
    layer = nn.Linear(2, 2).to(F64)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(2, dtype=F64))
        layer.bias.zero_()
    return layer


def test_accuracy_over_an_uneven_split_is_the_global_accuracy_not_a_mean_of_replicas():
    # The model outputs its input (identity weights, lr=0), so every prediction is set by hand.
    scores = torch.tensor(
        [[2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [0.0, 1.0]], dtype=F64
    )
    labels = torch.tensor([0, 0, 1, 1, 1, 0, 1])
    # Batch 1 (5 examples) splits 2, 2, 1 over 3 replicas: replica accuracies 1/2, 0/2, 1/1 (mean 0.5).
    # Batch 2 (2 examples) splits 1, 1, 0: the empty replica counts for nothing. Rows 0, 4, 5, 6 are right.
    batches = [(scores[:5], labels[:5]), (scores[5:], labels[5:])]
    model = _identity_linear()
    strategy = make_strategy(3)
    try:
        history = sg.fit(
            strategy,
            model,
            torch.optim.SGD(model.parameters(), lr=0.0),
            F.cross_entropy,
            batches,
            metrics=["accuracy"],
            validation_data=batches,
        )
    finally:
        strategy.close()
    metrics = history.epochs[0].metrics
    assert metrics["accuracy"] == metrics["val_accuracy"] == pytest.approx(4 / 7)
    assert metrics["loss"] == pytest.approx(float(F.cross_entropy(scores, labels)), rel=1e-12)
    assert metrics["val_loss"] == pytest.approx(metrics["loss"], rel=1e-12)


def test_a_data_set_with_a_batch_size_is_batched_and_shuffled_by_seed():
    x = torch.randn(30, 6, dtype=F64, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 4, (30,), generator=torch.Generator().manual_seed(4))
    model, optimizer, _ = build("mlp", "adam", F64)
    strategy = make_strategy(2)
    try:
        history = sg.fit(
            strategy,
            model,
            optimizer,
            F.cross_entropy,
            TensorDataset(x, y),
            batch_size=8,
            seed=5,
            epochs=2,
            clip_grad_norm=1.0,
        )
    finally:
        strategy.close()
    # The documented order: epoch e is torch.randperm(30) from a generator seeded seed * 1_000_003 + e + 1.
    expected = []
    for epoch in range(2):
        order = torch.randperm(30, generator=torch.Generator().manual_seed(5 * 1_000_003 + epoch + 1))
        expected += [(x[idx], y[idx]) for idx in order.split(8)]
    reference, ref_opt, _ = build("mlp", "adam", F64)
    train_reference(reference, ref_opt, expected)
    assert_same_state(reference, history.model, F64)
    assert [log.num_examples for log in history.epochs] == [30, 30]


def test_fit_again_continues_training_the_same_model():
    batches = make_batches((6,), F64)
    reference, ref_opt, _ = build("mlp", "sgd_momentum", F64)
    train_reference(reference, ref_opt, batches * 3)
    model, optimizer, _ = build("mlp", "sgd_momentum", F64)
    strategy = make_strategy(2)
    try:
        first = sg.fit(strategy, model, optimizer, F.cross_entropy, batches, clip_grad_norm=1.0)
        sg.fit(strategy, model, optimizer, F.cross_entropy, batches, clip_grad_norm=1.0)  # the plain pair again
        last = sg.fit(strategy, first.model, first.optimizer, F.cross_entropy, batches, clip_grad_norm=1.0)
        with pytest.raises(sg.InputError, match="distributed with another optimizer"):
            sg.fit(strategy, model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, batches)
    finally:
        strategy.close()
    assert last.model is first.model
    assert_same_state(reference, last.model, F64)
    with pytest.raises(
        sg.InputError,
        match=r"The model was distributed by another strategy. Received: a DistributedModel "
        r"of MirroredStrategy",
    ):
        sg.fit(make_strategy(1), first.model, first.optimizer, F.cross_entropy, batches)


class ReversingStrategy(sg.OneDeviceStrategy):
    """Runs each epoch's steps in reverse order through the `run_fit_steps` extension point."""

    def __init__(self) -> None:
        super().__init__("cpu:0", registry=cpu_registry(1))
        self.calls = 0

    def run_fit_steps(self, step_fn, batches, on_step) -> None:
        self.calls += 1
        for x, y in reversed(list(batches)):
            on_step(self.reduce("sum", self.run(step_fn, args=(x, y))).to(torch.float64))


def test_a_strategy_can_run_the_step_loop_its_own_way():
    batches = make_batches((6,), F64)
    reference, ref_opt, _ = build("mlp", "adam", F64)
    train_reference(reference, ref_opt, list(reversed(batches)) * 2)
    model, optimizer, _ = build("mlp", "adam", F64)
    strategy = ReversingStrategy()
    history = sg.fit(strategy, model, optimizer, F.cross_entropy, batches, epochs=2, clip_grad_norm=1.0)
    assert strategy.calls == 2
    assert_same_state(reference, history.model, F64)
    assert history.epochs[1].num_examples == 37


class Recorder(Callback):
    def __init__(self, stop_at_step: int | None = None) -> None:
        self.events: list[tuple] = []
        self.stop_at_step = stop_at_step

    def on_train_begin(self, context):
        self.events.append(("train_begin", context.epoch, context.step))

    def on_epoch_begin(self, context):
        self.events.append(("epoch_begin", context.epoch))

    def on_train_batch_end(self, context, num_examples):
        self.events.append(("batch_end", context.step, context.step_in_epoch, num_examples))
        if context.step == self.stop_at_step:
            context.stop_training = True

    def on_epoch_end(self, context, log):
        self.events.append(("epoch_end", log.epoch, log.num_examples))

    def on_train_end(self, context, history):
        self.events.append(("train_end", len(history.epochs)))


def test_callbacks_see_every_step_and_steps_per_epoch_limits_an_epoch():
    batches = make_batches((6,), F64)
    recorder = Recorder()
    model, optimizer, _ = build("mlp", "sgd_momentum", F64)
    sg.fit(
        sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1)),
        model,
        optimizer,
        F.cross_entropy,
        batches,
        epochs=2,
        steps_per_epoch=2,
        callbacks=[recorder],
    )
    assert recorder.events == [
        ("train_begin", 0, 0),
        ("epoch_begin", 0),
        ("batch_end", 1, 1, 12),
        ("batch_end", 2, 2, 11),
        ("epoch_end", 1, 23),
        ("epoch_begin", 1),
        ("batch_end", 3, 1, 12),
        ("batch_end", 4, 2, 11),
        ("epoch_end", 2, 23),
        ("train_end", 2),
    ]


def test_a_callback_can_stop_training_after_a_step():
    recorder = Recorder(stop_at_step=3)
    model, optimizer, _ = build("mlp", "sgd_momentum", F64)
    history = sg.fit(
        sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1)),
        model,
        optimizer,
        F.cross_entropy,
        make_batches((6,), F64),
        epochs=5,
        callbacks=[recorder],
    )
    assert [log.num_examples for log in history.epochs] == [12 + 11 + 7]
    assert recorder.events[-2:] == [("epoch_end", 1, 30), ("train_end", 1)]


def test_progress_bar_prints_one_line_per_epoch_and_fit_is_quiet_by_default(capsys):
    batches = make_batches((6,), F64)
    model, optimizer, _ = build("mlp", "sgd_momentum", F64)
    strategy = sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1))
    sg.fit(strategy, model, optimizer, F.cross_entropy, batches, epochs=2, metrics=["accuracy"])
    assert capsys.readouterr().out == ""
    out = io.StringIO()
    bar = ProgressBar(Console(file=out, width=200), show_bar=True)
    history = sg.fit(
        strategy, model, optimizer, F.cross_entropy, batches, epochs=2, metrics=["accuracy"], callbacks=[bar]
    )
    lines = [line for line in out.getvalue().splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2
    log = history.epochs[1]
    assert lines[1].startswith(f"epoch 2/2  loss {log.metrics['loss']:.4f}  accuracy {log.metrics['accuracy']:6.2%}")
    assert lines[1].endswith("samples/s)")
    assert capsys.readouterr().out == ""


def _fit(**overrides):
    model, optimizer, _ = build("mlp", "sgd_momentum", F64)
    args = {
        "strategy": sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1)),
        "model": model,
        "optimizer": optimizer,
        "loss": F.cross_entropy,
        "data": make_batches((6,), F64),
    }
    args.update(overrides)
    return sg.fit(**args)


x6, y6 = torch.zeros(4, 6, dtype=F64), torch.zeros(4, dtype=torch.int64)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"epochs": 0}, r"epochs must be a positive integer. Received: epochs=0"),
        ({"steps_per_epoch": 1.5}, r"steps_per_epoch must be a positive integer. Received: steps_per_epoch=1.5"),
        ({"clip_grad_norm": -1.0}, r"clip_grad_norm must be a positive number or None. Received: clip_grad_norm=-1.0"),
        ({"strategy": "mirrored"}, r"needs a stratagem strategy first. Received: str"),
        ({"optimizer": "adam"}, r"needs a torch.optim.Optimizer. Received: str"),
        ({"loss": 3}, r"loss must be a function of \(outputs, targets\). Received: int"),
        ({"data": x6}, r"data must be an iterable of GLOBAL \(inputs, targets\) batches.*Received: Tensor"),
        ({"data": (x6, y6)}, r"data is a pair of tensors: give a batch size"),
        (
            {"data": DataLoader(TensorDataset(x6, y6), batch_size=2), "batch_size": 2},
            r"data is already an iterable of batches.*Received: DataLoader with a batch size of 2",
        ),
        ({"data": (x6, y6), "batch_size": 0}, r"batch_size must be a positive integer. Received: batch_size=0"),
        ({"metrics": ["accuracy", "f1"]}, r"Unknown metric. Received: 'f1'. Choose one of accuracy"),
        ({"metrics": ["accuracy", "accuracy"]}, r"Metric names must be distinct.*Received: \['accuracy', 'accuracy'\]"),
        ({"callbacks": [print]}, r"Every callback must be a stratagem.train.Callback. Received: builtin_function"),
        ({"validation_data": (x6, y6)}, r"validation_data is a pair of tensors: give a batch size"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(overrides, message):
    with pytest.raises(sg.InputError, match=message):
        _fit(**overrides)


def test_batches_that_are_not_pairs_and_empty_data_are_errors():
    with pytest.raises(
        sg.InputError,
        match=r"With a loss function, each batch must be an \(inputs, targets\) pair or a dict.*Received: a tuple of 3",
    ):
        _fit(data=[(x6, y6, y6)])
    with pytest.raises(sg.InputError, match=r"Epoch 1 had no training example"):
        _fit(data=[])


def test_a_loss_that_is_not_a_mean_is_refused():
    with pytest.raises(sg.InputError, match=r"The loss must be a scalar tensor.*Received: \(12,\)"):
        _fit(loss=lambda out, y: F.cross_entropy(out, y, reduction="none"))


def test_evaluate_needs_examples():
    model, _, _ = build("mlp", "sgd_momentum", F64)
    with pytest.raises(sg.InputError, match="The evaluation data yielded no examples"):
        sg.evaluate(sg.OneDeviceStrategy("cpu:0", registry=cpu_registry(1)), model, [], F.cross_entropy)


def test_metric_results_come_from_summed_states():
    # Two replicas' accuracy states [1, 2] and [3, 3] sum to [4, 5]: 0.8, not the mean of 0.5 and 1.0.
    metric = sg.metrics.Accuracy()
    first = metric.state(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([0, 1]))
    second = metric.state(torch.tensor([[0.0, 1.0]] * 3), torch.tensor([1, 1, 1]))
    assert first.tolist() == [1.0, 2.0] and second.tolist() == [3.0, 3.0]
    assert metric.result(first + second) == pytest.approx(0.8)
    binary = sg.metrics.BinaryAccuracy()
    assert binary.result(binary.state(torch.tensor([2.0, -1.0, 0.5]), torch.tensor([1.0, 0.0, 0.0]))) == pytest.approx(
        2 / 3
    )
    mae, mse = sg.metrics.MeanAbsoluteError(), sg.metrics.MeanSquaredError()
    assert mae.result(mae.state(torch.tensor([1.0, 3.0]), torch.tensor([2.0, 0.0]))) == pytest.approx(2.0)
    assert mse.result(mse.state(torch.tensor([[1.0], [3.0]]), torch.tensor([2.0, 0.0]))) == pytest.approx(5.0)
    with pytest.raises(sg.InputError, match=r"accuracy needs scores of shape \(batch, classes\).*Received: .*\(3,\)"):
        metric.state(torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0, 1, 0]))


class WrongSize(sg.metrics.Metric):
    name, state_size = "wrong", 2

    def state(self, outputs, targets):
        return torch.zeros(3)

    def result(self, totals):
        return 0.0


def test_a_metric_whose_state_has_the_wrong_size_is_named():
    with pytest.raises(sg.InputError, match=r"Metric 'wrong' returned a state of 3 value\(s\). Received: state_size=2"):
        _fit(metrics=[WrongSize()])
    with pytest.raises(sg.InputError, match=r"A metric is a name or a stratagem.train.Metric. Received: int"):
        _fit(metrics=[3])
