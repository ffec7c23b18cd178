"""Gradient accumulation: K micro-batches of backward before one optimizer step equal one device
accumulating the same K micro-batch gradients, with and without `strategy.no_sync()`, and
`sg.fit(..., accumulate_steps=K)` equals one device's update on the mean loss over each group.

The micro-batch sizes split unevenly over 2 and 3 replicas and give some replicas an empty slice in
a micro-batch inside no_sync(), so each replica's weight changes from one micro-batch to the next.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from cases import TOL, assert_same_state, build, make_batches
from conftest import cpu_registry
from helpers import launch_workers
from in_process_strategies import STRATEGIES

import stratagem as sg
from stratagem.errors import InputError

K = 3
# Groups of K micro-batches: over 3 replicas, 2 -> (1, 1, 0) and 1 -> (1, 0, 0) inside no_sync(); over
# 4 (2 workers x 2), 2 -> (1, 1, 0, 0) and 1 -> (1, 0, 0, 0). The batches that end a group fill every replica.
SIZES = [5, 2, 4, 7, 1, 6]


def reference_accumulation(model, optimizer, batches, k=K):
    """One device: the K micro-batch gradients summed in .grad, then one clipped step."""
    for i, (x, y) in enumerate(batches):
        F.cross_entropy(model(x), y).backward()
        if i % k == k - 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()


def train_accumulating(strategy, model, optimizer, batches, use_no_sync, k=K):
    model, optimizer = strategy.distribute(model, optimizer)

    def micro_step(x, y, last):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if last:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        return loss

    for i, (x, y) in enumerate(strategy.distribute_dataset(batches)):
        last = i % k == k - 1
        with strategy.no_sync() if use_no_sync and not last else contextlib.nullcontext():
            strategy.run(micro_step, args=(x, y, last))
    return model


@pytest.mark.parametrize("use_no_sync", [False, True], ids=["every-backward-combines", "no-sync"])
@pytest.mark.parametrize("strategy_name", sorted(STRATEGIES))
@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam"])
def test_accumulated_micro_batches_match_one_device(strategy_name, opt_name, use_no_sync):
    reference, ref_opt, shape = build("mlp", opt_name, torch.float64)
    batches = make_batches(shape, torch.float64, sizes=SIZES)
    reference_accumulation(reference, ref_opt, batches)
    model, opt, _ = build("mlp", opt_name, torch.float64)
    strategy = STRATEGIES[strategy_name]()
    try:
        model = train_accumulating(strategy, model, opt, batches, use_no_sync)
    finally:
        getattr(strategy, "close", lambda: None)()
    assert_same_state(reference, model, torch.float64)


def test_inside_no_sync_each_replica_keeps_its_own_gradient():
    """Proof that no_sync() skips the combination: after it the replicas' gradients differ, each its own
    slice's gradient times its share; the synchronising backward then gives every replica the same."""
    model, _, shape = build("mlp", "sgd_momentum", torch.float64)
    ((x, y),) = make_batches(shape, torch.float64, sizes=[5])
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], share_parameters=False, registry=cpu_registry(2))
    dist = strategy.distribute(model)
    plain = [build("mlp", "sgd_momentum", torch.float64)[0] for _ in range(2)]
    for net, (lo, hi) in zip(plain, [(0, 3), (3, 5)]):
        F.cross_entropy(net(x[lo:hi]), y[lo:hi]).backward()

    def backward(a, b):
        F.cross_entropy(dist(a), b).backward()

    batch = next(iter(strategy.distribute_dataset([(x, y)])))
    with strategy.no_sync():
        strategy.run(backward, args=batch)
    for replica, net, share in zip(dist.replicas, plain, [3 / 5, 2 / 5]):
        for got, own in zip(replica.parameters(), net.parameters()):
            torch.testing.assert_close(got.grad, own.grad * share, **TOL[torch.float64])
    strategy.run(backward, args=batch)
    for got0, got1 in zip(dist.replicas[0].parameters(), dist.replicas[1].parameters()):
        torch.testing.assert_close(got0.grad, got1.grad, rtol=0, atol=0)
    strategy.close()


def _three_replica_setup():
    model, opt, shape = build("mlp", "sgd_momentum", torch.float64)
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3))
    model, opt = strategy.distribute(model, opt)
    return strategy, model, opt, shape


def test_a_synchronising_batch_with_an_empty_slice_is_refused_with_the_fix():
    strategy, model, opt, shape = _three_replica_setup()
    batches = list(strategy.distribute_dataset(make_batches(shape, torch.float64, sizes=[4, 2])))

    def backward(x, y):
        F.cross_entropy(model(x), y).backward()

    with strategy.no_sync():
        strategy.run(backward, args=batches[0])
    with pytest.raises(InputError, match="replica 2's slice of its batch is empty.*at least as many examples"):
        strategy.run(backward, args=batches[1])
    strategy.close()


def test_optimizer_step_on_uncombined_gradients_is_refused():
    strategy, model, opt, shape = _three_replica_setup()
    batch = next(iter(strategy.distribute_dataset(make_batches(shape, torch.float64, sizes=[6]))))

    def backward_and_step(x, y):
        F.cross_entropy(model(x), y).backward()
        opt.step()

    with (
        strategy.no_sync(),
        pytest.raises(InputError, match="optimizer.step\\(\\) was called on gradients accumulated"),
    ):
        strategy.run(backward_and_step, args=batch)
    strategy.close()


def test_no_sync_inside_the_step_function_is_refused_with_the_fix():
    strategy, model, opt, shape = _three_replica_setup()
    batch = next(iter(strategy.distribute_dataset(make_batches(shape, torch.float64, sizes=[6]))))

    def step(x, y):
        with strategy.no_sync():
            F.cross_entropy(model(x), y).backward()

    with pytest.raises(InputError, match="Enter it around the call"):
        strategy.run(step, args=batch)
    strategy.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("local", [1, 2], ids=["2x1-buckets", "2x2-local-then-workers"])
def test_no_sync_across_workers_matches_one_device(tmp_path, local):
    out = tmp_path / "result.pt"
    exit_code, output = launch_workers(
        "accumulate_train.py",
        {"ACC_OUT": str(out), "ACC_LOCAL": str(local), "ACC_K": str(K), "ACC_SIZES": ",".join(map(str, SIZES))},
        timeout=150,
        tail=30,
    )
    assert exit_code == 0, output
    reference, ref_opt, shape = build("mlp", "adam", torch.float64)
    reference_accumulation(reference, ref_opt, make_batches(shape, torch.float64, sizes=SIZES))
    saved = [torch.load(f"{out}.{rank}") for rank in range(2)]
    for rank in range(2):
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(
                saved[rank]["state"][key], value, **TOL[torch.float64], msg=lambda m, k=key: f"{k}: {m}"
            )
    # After the first no_sync() run each worker holds its own slices' gradient: nothing was all-reduced.
    assert (saved[0]["first_grad"] - saved[1]["first_grad"]).abs().max() > 1e-3


# ---- fit(accumulate_steps=K) ----------------------------------------------------------------------
def reference_group_means(model, optimizer, batches, k):
    """One device: each group of k batches trained as one batch of all its examples (mean loss over the
    group), written as k backward passes of micro-batch losses weighted by their share of the group."""
    for start in range(0, len(batches), k):
        group = batches[start : start + k]
        total = sum(len(y) for _, y in group)
        for x, y in group:
            (F.cross_entropy(model(x), y) * (len(y) / total)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()


class _CountSteps(sg.callbacks.Callback):
    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, context, num_examples):
        self.steps.append((context.step, context.step_in_epoch, num_examples))


# 7 batches, k=3: groups of 3, 3 and a short last one of 1.
FIT_SIZES = [5, 2, 4, 7, 1, 6, 3]


@pytest.mark.parametrize("strategy_name", ["one-device", "mirrored-3", "central-3"])
def test_fit_with_accumulate_steps_matches_one_batch_per_group(strategy_name):
    reference, ref_opt, shape = build("mlp", "adam", torch.float64)
    batches = make_batches(shape, torch.float64, sizes=FIT_SIZES)
    reference_group_means(reference, ref_opt, batches, K)
    model, opt, _ = build("mlp", "adam", torch.float64)
    counter = _CountSteps()
    strategy = STRATEGIES[strategy_name]()
    history = sg.fit(
        strategy, model, opt, F.cross_entropy, batches, accumulate_steps=K, clip_grad_norm=1.0, callbacks=[counter]
    )
    strategy.close()
    assert_same_state(reference, history.model, torch.float64)
    # A step is an update; the data position counts batches; examples per update are the group's.
    assert counter.steps == [(1, 3, 11), (2, 6, 14), (3, 7, 3)]
    assert history.epochs[0].num_examples == sum(FIT_SIZES)


def test_fit_with_accumulate_steps_reports_the_loss_over_every_example():
    model, opt, shape = build("mlp", "sgd_momentum", torch.float64)
    batches = make_batches(shape, torch.float64, sizes=FIT_SIZES)
    probe, _, _ = build("mlp", "sgd_momentum", torch.float64)
    with torch.no_grad():  # the first group's loss is measured before its update: the initial parameters'
        first = sum(F.cross_entropy(probe(x), y, reduction="sum") for x, y in batches[:K]) / sum(FIT_SIZES[:K])
    steps = []

    class FirstLoss(sg.callbacks.Callback):
        def on_train_batch_end(self, context, num_examples):
            steps.append(context.running_metrics()["loss"])

    sg.fit(
        sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2)),
        model,
        opt,
        F.cross_entropy,
        batches,
        accumulate_steps=K,
        callbacks=[FirstLoss()],
    )
    assert steps[0] == pytest.approx(float(first), rel=1e-12)


class _WithLogits(torch.nn.Module):
    """A model that returns what a Hugging Face model returns: an object with `.logits`."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        from transformers.modeling_outputs import SequenceClassifierOutput

        return SequenceClassifierOutput(logits=self.inner(x))


@pytest.mark.parametrize("form", ["pairs", "dicts"])
def test_fit_with_accumulate_steps_calls_the_model_and_loss_as_fits_own_step(form):
    # The micro-step once passed the output object itself to loss(outputs, targets), and read a device from the
    # targets, which a dict batch carries under "labels": fit's plain step does neither.
    reference, ref_opt, shape = build("mlp", "adam", torch.float64)
    batches = make_batches(shape, torch.float64, sizes=FIT_SIZES)
    reference_group_means(reference, ref_opt, batches, K)
    model, opt, _ = build("mlp", "adam", torch.float64)
    data = batches if form == "pairs" else [{"x": x, "labels": y} for x, y in batches]
    history = sg.fit(
        sg.OneDeviceStrategy("cpu"), _WithLogits(model), opt, F.cross_entropy, data, accumulate_steps=K,
        clip_grad_norm=1.0, metrics=["accuracy"],
    )  # fmt: skip
    assert_same_state(reference, history.model.inner, torch.float64)
    assert 0.0 <= history.epochs[0].metrics["accuracy"] <= 1.0


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_fit_refuses_an_accumulate_steps_that_is_not_a_positive_count(bad):
    model, opt, shape = build("mlp", "sgd_momentum", torch.float64)
    with pytest.raises(InputError, match="accumulate_steps must be a positive whole number"):
        sg.fit(
            sg.OneDeviceStrategy("cpu"),
            model,
            opt,
            F.cross_entropy,
            make_batches(shape, torch.float64),
            accumulate_steps=bad,
        )


def test_fit_refuses_accumulate_steps_without_a_loss_function():
    # loss=None (the model's own loss) once reached the micro-step's loss(outputs, targets): a bare TypeError.
    model, opt, shape = build("mlp", "sgd_momentum", torch.float64)
    with pytest.raises(InputError, match="Gradient accumulation needs a loss function. Received: loss=None"):
        sg.fit(sg.OneDeviceStrategy("cpu"), model, opt, None, make_batches(shape, torch.float64), accumulate_steps=2)


@pytest.mark.timeout(60)
def test_fit_refuses_accumulate_steps_under_the_parameter_server():
    from stratagem.strategies.parameter_server import InProcessCluster, ParameterServerStrategy

    model, opt, shape = build("mlp", "sgd_momentum", torch.float64)
    with InProcessCluster(num_workers=1, num_ps=1) as cluster:
        strategy = ParameterServerStrategy(cluster)
        try:
            with pytest.raises(InputError, match="accumulate_steps needs a synchronous strategy"):
                sg.fit(strategy, model, opt, F.cross_entropy, make_batches(shape, torch.float64), accumulate_steps=2)
        finally:
            strategy.shutdown()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_fit_with_accumulate_steps_across_workers_matches_one_batch_per_group(tmp_path):
    """2 workers x 2 replicas: each micro-batch's scale comes from the global count, which each worker
    learns from its distributed batch (its own part of it is smaller)."""
    out = tmp_path / "result.pt"
    exit_code, output = launch_workers(
        "accumulate_train.py",
        {
            "ACC_OUT": str(out),
            "ACC_LOCAL": "2",
            "ACC_K": str(K),
            "ACC_FIT": "1",
            "ACC_SIZES": ",".join(map(str, FIT_SIZES)),
        },
        timeout=150,
        tail=30,
    )
    assert exit_code == 0, output
    reference, ref_opt, shape = build("mlp", "adam", torch.float64)
    reference_group_means(reference, ref_opt, make_batches(shape, torch.float64, sizes=FIT_SIZES), K)
    for rank in range(2):
        saved = torch.load(f"{out}.{rank}")
        assert saved["num_examples"] == sum(FIT_SIZES)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(
                saved["state"][key], value, **TOL[torch.float64], msg=lambda m, k=key: f"{k}: {m}"
            )
