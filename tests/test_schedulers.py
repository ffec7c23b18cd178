"""torch LR schedulers on a distributed optimizer: one step per global step, whether
`scheduler.step()` is called in the step function (by every replica thread, on the scheduler handed
to `strategy.distribute_scheduler`) or outside `strategy.run`, built after `distribute` or before it;
the rates step by step, `get_last_lr()`, `state_dict()` and the parameters agree with one device; a
scheduler stepped in the step function without being handed over is refused; and the same under
`sg.fit`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cases import TOL, assert_same_state, make_batches, mlp, train_step
from conftest import cpu_registry

import stratagem as sg

S = torch.optim.lr_scheduler
SIZES = [12, 7, 5, 2]
SCHEDULERS = {
    "step": lambda o: S.StepLR(o, step_size=2, gamma=0.5),
    "one_cycle": lambda o: S.OneCycleLR(o, max_lr=[0.2, 0.1], total_steps=6),  # cycles the momentum too
    "lambda": lambda o: S.LambdaLR(o, lambda epoch: 1.0 / (1 + epoch)),
    "cosine": lambda o: S.CosineAnnealingLR(o, T_max=3),
    "sequential": lambda o: S.SequentialLR(
        o, [S.LinearLR(o, start_factor=0.5, total_iters=2), S.ExponentialLR(o, gamma=0.8)], milestones=[2]
    ),
}
STRATEGIES = {
    "mirrored2": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2)),
    "mirrored2-private": lambda: sg.MirroredStrategy(
        ["cpu:0", "cpu:1"], share_parameters=False, registry=cpu_registry(2)
    ),
    "mirrored3": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3)),
    "central2": lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2)),
}


def _fresh():
    torch.manual_seed(42)
    model = mlp().double()
    params = list(model.parameters())
    optimizer = torch.optim.SGD([{"params": params[:2], "lr": 0.05}, {"params": params[2:]}], lr=0.1, momentum=0.9)
    return model, optimizer


def _reference(make_scheduler, batches, rates=None):
    """Plain one-device training; `rates`, when given, gets every group's rate after each step."""
    model, optimizer = _fresh()
    scheduler = make_scheduler(optimizer)
    for x, y in batches:
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if rates is not None:
            rates.append([g["lr"] for g in optimizer.param_groups])
    return model, scheduler


def _assert_same_scheduler(got, expected):
    assert got.last_epoch == expected.last_epoch
    assert got.get_last_lr() == pytest.approx(expected.get_last_lr(), rel=1e-12)
    assert _comparable(got.state_dict()) == _comparable(expected.state_dict())


def _comparable(state):
    """A scheduler's state_dict with floats rounded (one device and the replicas compute them alike)."""
    if isinstance(state, dict):
        return {k: _comparable(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [_comparable(v) for v in state]
    if isinstance(state, float):
        return round(state, 12)
    return state


# Stepped in the step function (handed over), built after or before distribute: every strategy. Stepped after
# run, handed over or not: Mirrored x2 and CentralStorage x2.
WAYS = (
    [(name, "inside", order, "handed") for name in STRATEGIES for order in ("after", "before")]
    + [
        (name, "outside", order, handed)
        for name in ("mirrored2", "central2")
        for order in ("after", "before")
        for handed in ("handed", "kept")
    ]
    + [("mirrored2-private", "outside", "before", "kept")]
)


@pytest.mark.parametrize("strategy_name,where,order,handed", WAYS, ids=["-".join(way) for way in WAYS])
@pytest.mark.parametrize("scheduler_name", list(SCHEDULERS))
def test_a_scheduler_steps_once_per_global_step(scheduler_name, strategy_name, where, order, handed):
    make_scheduler = SCHEDULERS[scheduler_name]
    batches = make_batches((6,), torch.float64, sizes=SIZES)
    expected_rates: list[list[float]] = []
    reference, expected = _reference(make_scheduler, batches, expected_rates)

    strategy = STRATEGIES[strategy_name]()
    model, optimizer = _fresh()
    if order == "before":
        scheduler = make_scheduler(optimizer)
    model, optimizer = strategy.distribute(model, optimizer)
    if order == "after":
        scheduler = make_scheduler(optimizer)
    if handed == "handed":
        scheduler = strategy.distribute_scheduler(scheduler)

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if where == "inside":
            scheduler.step()  # every replica thread calls it
        return optimizer.param_groups[0]["lr"]

    lrs, rates = [], []
    for x, y in strategy.distribute_dataset(batches):
        seen = strategy.run(step, args=(x, y))
        lrs.append(seen.values if where == "inside" else None)
        if where == "outside":
            scheduler.step()
        rates.append([g["lr"] for g in optimizer.param_groups])
    assert len(rates) == len(expected_rates)
    for step_rates, expected_step_rates in zip(rates, expected_rates):  # step by step
        assert step_rates == pytest.approx(expected_step_rates, rel=1e-12)
    _assert_same_scheduler(scheduler, expected)
    assert_same_state(reference, model, torch.float64)
    if where == "inside":  # after the step every replica reads the new value
        for values in lrs:
            assert len(set(values)) == 1, values
    assert [g["lr"] for g in optimizer.state_dict()["param_groups"]] == pytest.approx(expected.get_last_lr())


@pytest.mark.parametrize("order", ["after", "before"])
@pytest.mark.parametrize("strategy_name", ["mirrored2", "mirrored2-private", "central2"])
def test_reduce_lr_on_plateau_outside_run_with_the_global_loss_matches_one_device(strategy_name, order):
    batches = make_batches((6,), torch.float64, sizes=SIZES)
    make = lambda o: S.ReduceLROnPlateau(o, factor=0.5, patience=0, threshold=0.5)  # noqa: E731 - reduces on step 2

    model, optimizer = _fresh()
    expected = make(optimizer)
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.step(loss.item())
    reference = model

    strategy = STRATEGIES[strategy_name]()
    model, optimizer = _fresh()
    scheduler = make(optimizer) if order == "before" else None
    model, optimizer = strategy.distribute(model, optimizer)
    scheduler = scheduler or make(optimizer)
    step = train_step(model, optimizer, clip=False)
    for x, y in strategy.distribute_dataset(batches):
        scheduler.step(strategy.reduce("mean", strategy.run(step, args=(x, y))).item())
    assert expected.get_last_lr() != [0.05, 0.1], "the case reduces the rate at least once"
    _assert_same_scheduler(scheduler, expected)
    assert_same_state(reference, model, torch.float64)


def test_reduce_lr_on_plateau_inside_run_is_refused_with_the_fix():
    strategy = STRATEGIES["mirrored2"]()
    model, optimizer = strategy.distribute(*_fresh())
    scheduler = strategy.distribute_scheduler(S.ReduceLROnPlateau(optimizer))

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step(loss.item())

    x, y = make_batches((6,), torch.float64, sizes=[4])[0]
    with pytest.raises(
        sg.InputError,
        match=r"ReduceLROnPlateau.step\(metric\) ran inside strategy.run\(\), where each "
        r"replica holds the metric of its own slice .* Call scheduler.step\(metric\) "
        r"outside strategy.run\(\)",
    ):
        strategy.run(step, args=strategy.distribute_dataset([(x, y)]).__iter__().__next__())


def test_a_replica_that_skips_scheduler_step_is_named():
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2), timeout=30)
    model, optimizer = strategy.distribute(*_fresh())
    scheduler = strategy.distribute_scheduler(S.StepLR(optimizer, step_size=1))

    def step(x, y):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if sg.current_replica_context().replica_id_in_sync_group == 0:
            scheduler.step()

    batch = next(iter(strategy.distribute_dataset(make_batches((6,), torch.float64, sizes=[4]))))
    with pytest.raises(
        sg.ReplicaError,
        match=r"at the scheduler step of step 1, but replica 1 \(cpu:1\) returned "
        r"from the step function .* must call scheduler.step\(\)",
    ):
        strategy.run(step, args=batch)


@pytest.mark.parametrize("strategy_name", ["mirrored2", "mirrored2-private", "central2"])
def test_fit_steps_a_scheduler_once_per_global_step(strategy_name):
    batches = make_batches((6,), torch.float64, sizes=SIZES)
    make_scheduler = SCHEDULERS["one_cycle"]
    reference, expected = _reference(make_scheduler, batches)
    strategy = STRATEGIES[strategy_name]()
    model, optimizer = strategy.distribute(*_fresh())
    schedule = sg.callbacks.LearningRateScheduler(make_scheduler(optimizer), interval="step")
    history = sg.fit(strategy, model, optimizer, F.cross_entropy, batches, epochs=1, callbacks=[schedule])
    _assert_same_scheduler(schedule.scheduler, expected)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(history.model.state_dict()[key], value, **TOL[torch.float64])


@pytest.mark.parametrize("strategy_name", ["mirrored2", "central2"])
def test_fit_takes_a_scheduler_built_on_the_plain_optimizer_it_distributes(strategy_name):
    # One script for every strategy: on one device the scheduler on the user's optimizer is the one that
    # trains, so fit must take it under every strategy.
    batches = make_batches((6,), torch.float64, sizes=SIZES)
    make_scheduler = SCHEDULERS["step"]
    reference, expected = _reference(make_scheduler, batches)
    model, optimizer = _fresh()
    schedule = sg.callbacks.LearningRateScheduler(make_scheduler(optimizer), interval="step")
    history = sg.fit(
        STRATEGIES[strategy_name](), model, optimizer, F.cross_entropy, batches, epochs=1, callbacks=[schedule]
    )
    _assert_same_scheduler(schedule.scheduler, expected)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(history.model.state_dict()[key], value, **TOL[torch.float64])


@pytest.mark.parametrize("order", ["after", "before"])
def test_a_chained_scheduler_steps_its_parts_once_per_global_step(order):
    def make(o):
        return S.ChainedScheduler([S.StepLR(o, step_size=2, gamma=0.5), S.ExponentialLR(o, gamma=0.9)], optimizer=o)

    batches = make_batches((6,), torch.float64, sizes=SIZES)
    reference, expected = _reference(make, batches)
    strategy = STRATEGIES["mirrored2"]()
    model, optimizer = _fresh()
    scheduler = make(optimizer) if order == "before" else None
    model, optimizer = strategy.distribute(model, optimizer)
    scheduler = strategy.distribute_scheduler(scheduler or make(optimizer))

    def step(x, y):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    for x, y in strategy.distribute_dataset(batches):
        strategy.run(step, args=(x, y))
    assert scheduler.get_last_lr() == pytest.approx(expected.get_last_lr(), rel=1e-12)
    assert _comparable(scheduler.state_dict()) == _comparable(expected.state_dict())
    assert_same_state(reference, model, torch.float64)


@pytest.mark.parametrize("order", ["after", "before"])
@pytest.mark.parametrize("strategy_name", ["mirrored2", "mirrored2-private", "central2"])
def test_a_scheduler_stepped_inside_run_without_being_handed_over_is_refused(strategy_name, order):
    # StepLR(step_size=1) changes the rate at every step, so the first step's writes are seen.
    strategy = STRATEGIES[strategy_name]()
    model, optimizer = _fresh()
    scheduler = S.StepLR(optimizer, step_size=1, gamma=0.5) if order == "before" else None
    model, optimizer = strategy.distribute(model, optimizer)
    scheduler = scheduler or S.StepLR(optimizer, step_size=1, gamma=0.5)

    def step(x, y):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    batch = next(iter(strategy.distribute_dataset(make_batches((6,), torch.float64, sizes=[4]))))
    with pytest.raises(sg.InputError) as raised:
        strategy.run(step, args=batch)
    message = str(raised.value)
    assert "inside strategy.run()" in message and "Received: param_groups[0]['lr']" in message
    assert "strategy.distribute_scheduler(scheduler)" in message


def test_a_rate_set_by_hand_inside_run_is_refused_and_outside_reaches_every_replica():
    strategy = STRATEGIES["mirrored2-private"]()
    model, optimizer = strategy.distribute(*_fresh())

    def step(x, y):
        F.cross_entropy(model(x), y).backward()
        optimizer.param_groups[0]["lr"] = 0.5

    batch = next(iter(strategy.distribute_dataset(make_batches((6,), torch.float64, sizes=[4]))))
    with pytest.raises(sg.InputError, match=r"Received: param_groups\[0\]\['lr'\] = 0.5 by replica"):
        strategy.run(step, args=batch)
    optimizer.param_groups[0]["lr"] = 0.25

    def step_and_read(x, y):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        return [g["lr"] for g in optimizer.param_groups]

    seen = strategy.run(step_and_read, args=batch)
    assert [rate.values for rate in seen] == [(0.25, 0.25), (0.1, 0.1)]  # each group's rate on each replica


@pytest.mark.parametrize("strategy_name", ["mirrored2", "central2"])
def test_handing_a_scheduler_over_leaves_the_users_objects_as_they_were(strategy_name):
    strategy = STRATEGIES[strategy_name]()
    model, optimizer = _fresh()
    scheduler = S.StepLR(optimizer, step_size=1, gamma=0.5)
    before = dict(vars(scheduler))
    distributed_model, distributed_optimizer = strategy.distribute(model, optimizer)
    handed = strategy.distribute_scheduler(scheduler)
    assert handed is not scheduler and handed.scheduler is scheduler
    assert type(scheduler) is S.StepLR and "step" not in vars(scheduler) and "state_dict" not in vars(scheduler)
    assert vars(scheduler) == before
    assert handed.state_dict() == scheduler.state_dict()
    assert "_opt_called" not in vars(optimizer)  # torch's own flag: set only by torch's wrapper of step()


def test_distribute_scheduler_refuses_a_scheduler_of_another_optimizer():
    strategy = STRATEGIES["mirrored2"]()
    strategy.distribute(*_fresh())
    _, other = _fresh()
    with pytest.raises(sg.InputError, match=r"did not distribute. Received: a StepLR of a SGD"):
        strategy.distribute_scheduler(S.StepLR(other, step_size=1))
