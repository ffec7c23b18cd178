"""A parameter update written by hand in the step function (`p.data.add_`, `p -= lr * p.grad` under no_grad,
`torch._foreach_add_`) counts once per global step under every synchronous strategy, or is refused naming
the parameter: never once per replica (issue 27, item 4). Expected values: the same script on one device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_registry
from hand_update_cases import IN_PLACE_WAYS, WAYS, batches, make_model, train, update
from helpers import launch_workers

import stratagem as sg
from stratagem.strategies.data_parallel.cpu_threads.hand_updates import HandUpdateGuard, InPlaceWatch
from stratagem.strategies.data_parallel.cpu_threads.replica_random import ReplicaRandom

STRATEGIES = {
    "one-device": lambda: sg.OneDeviceStrategy("cpu"),
    "mirrored-1": lambda: sg.MirroredStrategy(["cpu:0"], registry=cpu_registry(3)),
    "mirrored-2": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(3)),
    "mirrored-3": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3)),
    "central-2": lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(3)),
    "central-2-copies": lambda: sg.CentralStorageStrategy(
        ["cpu:0", "cpu:1"], share_parameters=False, registry=cpu_registry(3)
    ),
}


def assert_same(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=1e-12, msg=key)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_hand_written_update_counts_once_per_step(name: str, way: str) -> None:
    expected, expected_losses = train(None, way)
    strategy = STRATEGIES[name]()
    try:
        state, losses = train(strategy, way)
    finally:
        strategy.close()
    assert_same(state, expected)
    assert losses == pytest.approx(expected_losses, rel=1e-12)


def test_without_an_optimizer_logical_replicas_keep_a_copy_each_and_say_why() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    model = strategy.distribute(make_model())
    decision = strategy.explain().decision("parameter storage")
    assert decision.choice == "a private copy per replica"
    assert "no optimizer was given to distribute()" in decision.reason
    first, second = model.replicas
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(first.parameters(), second.parameters()))
    strategy.close()


def test_central_storage_without_an_optimizer_says_its_replicas_update_a_copy() -> None:
    strategy = sg.CentralStorageStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    strategy.distribute(make_model())
    decision = strategy.explain().decision("parameter copies")
    assert decision.choice == "one per step to 1 replica(s)"
    assert "no optimizer was given to distribute()" in decision.reason
    strategy.close()


# Strategies whose replicas share one copy of the parameters beside an optimizer (CentralStorage's compute copies
# too: a change there would be overwritten at the next step), and what the error says such a change does.
REFUSED = {
    "mirrored-2": (STRATEGIES["mirrored-2"], "share one copy of the parameters.*applied 2 times per step"),
    "mirrored-3": (STRATEGIES["mirrored-3"], "share one copy of the parameters.*applied 3 times per step"),
    "central-2": (STRATEGIES["central-2"], "applies once per replica"),
    "central-2-copies": (STRATEGIES["central-2-copies"], "overwritten at the next step"),
}
WEIGHT = r"Received: an in-place change of '0.weight' \(shape \(6, 4\)\)\. Update the parameters only through"


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _one_device_step(optimizer_step: bool) -> dict[str, torch.Tensor]:
    """The parameters after the first step on one device without the hand-written update: after the optimizer's
    update, or as they started."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batches()[0]
    F.cross_entropy(model(x), y).backward()
    if optimizer_step:
        optimizer.step()
    return _state(model)


def _distributed(name: str):
    strategy = REFUSED[name][0]()
    start = make_model()
    model, optimizer = strategy.distribute(start, torch.optim.SGD(start.parameters(), lr=0.1))
    return strategy, model, optimizer


@pytest.mark.parametrize("when", ["after-optimizer-step", "before-optimizer-step"])
@pytest.mark.parametrize("way", IN_PLACE_WAYS)
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_hand_written_update_beside_the_optimizer_is_refused_before_it_takes_effect(
    name: str, way: str, when: str
) -> None:
    strategy, model, optimizer = _distributed(name)
    after = when == "after-optimizer-step"
    by_hand = [True]

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if after:
            optimizer.step()
        if by_hand[0]:
            update(model, way)  # e.g. a weight decay written by hand
        if not after:
            optimizer.step()
        return loss.detach()

    x, y = batches()[0]
    optimizer_update = (
        "with this step's optimizer update, which ran before it"
        if after
        else "and this step's optimizer update has not run"
    )
    refused = (
        f"Parameter '0.weight' was about to be changed in place.*{REFUSED[name][1]}.*The change was refused before it "
        f"ran on any replica: the parameters hold their values from before it, {optimizer_update}. " + WEIGHT
    )
    try:
        with pytest.raises(sg.InputError, match=refused):
            strategy.step(step)(x, y)
        # Nothing of the hand-written update reached the parameters (the optimizer's update did, where it ran first).
        expected = _one_device_step(optimizer_step=after)
        assert_same(_state(model.module), expected)
        if not after:
            # A step that raised is checked again: the same step, retried, is refused before it runs too.
            with pytest.raises(sg.InputError, match=refused):
                strategy.step(step)(x, y)
            assert_same(_state(model.module), expected)
        # No replica was left waiting: the next step, without the update, trains.
        by_hand[0] = False
        loss = strategy.step(step)(*batches()[1])
        assert torch.isfinite(loss).all()
    finally:
        strategy.close()


@pytest.mark.parametrize("name", ["mirrored-2", "central-2"])
def test_a_hand_written_update_that_starts_after_the_first_step_is_refused_at_the_end_of_its_step(name: str) -> None:
    strategy, model, optimizer = _distributed(name)
    steps = []

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if len(steps) >= 2:  # replica 0 counts the steps: the others see the same count in a step
            update(model, "foreach")
        return loss.detach()

    try:
        for x, y in batches()[:2]:
            strategy.step(step)(x, y)
            steps.append(1)
        with pytest.raises(
            sg.InputError,
            match=f"Parameter '0.weight' was changed in place .*seen at the end of the step, after the change took "
            f"effect\\. .*{REFUSED[name][1]}.*" + WEIGHT,
        ):
            strategy.step(step)(*batches()[2])
    finally:
        strategy.close()


@pytest.mark.parametrize("name", ["one-device", "mirrored-2", "mirrored-3", "central-2"])
def test_a_wgan_clamp_through_p_data_beside_the_optimizer_trains_as_one_device(name: str) -> None:
    """A WGAN critic's weight clipping (`p.data.clamp_(-c, c)` after each update) changes another tensor object
    than the parameter, which no check sees; on shared parameters every replica clamps the same memory, which is
    idempotent, so it is left to train."""
    limit = 0.2

    def train_clamped(strategy: sg.Strategy | None) -> dict[str, torch.Tensor]:
        start = make_model()
        optimizer = torch.optim.RMSprop(start.parameters(), lr=0.05)
        model = start
        if strategy is not None:
            model, optimizer = strategy.distribute(start, optimizer)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            for p in model.parameters():
                p.data.clamp_(-limit, limit)
            return loss.detach()

        for x, y in batches():
            step(x, y) if strategy is None else strategy.step(step)(x, y)
        return _state(start)

    expected = train_clamped(None)
    assert any((v.abs() == limit).any() for v in expected.values())  # the clamp did bite
    strategy = STRATEGIES[name]()
    try:
        assert_same(train_clamped(strategy), expected)
    finally:
        strategy.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_hand_written_update_counts_once_across_two_workers(tmp_path) -> None:
    out = tmp_path / "result.pt"
    exit_code, output = launch_workers("mwms_hand_updates.py", {"MW_OUT": str(out)}, timeout=280)
    assert exit_code == 0, output
    saved = torch.load(out)
    for way, local in [*((way, 1) for way in WAYS), ("data_add", 2)]:
        expected, expected_losses = train(None, way)
        state, losses = saved[(way, local)]
        assert_same(state, expected)
        assert losses == pytest.approx(expected_losses, rel=1e-12), (way, local)


def test_a_foreach_update_under_both_replica_modes_moves_each_version_counter_once() -> None:
    """A replica's random stream (replica_random.py) and the check before a change are both dispatch modes, under
    which torch leaves a foreach operator's version counters alone; between them they move each counter once, as
    outside any mode (the watch at the end of a step subtracts exactly one for each of the strategy's writes)."""
    guard = HandUpdateGuard()
    guard.add(InPlaceWatch([(0, make_model())], consequence="", fix=""))
    guard.begin_step()
    tensors = [torch.zeros(2), torch.zeros(3)]
    with ReplicaRandom(torch.Generator()), guard.around(0):
        torch._foreach_add_(tensors, 1.0)
    with guard.around(0), ReplicaRandom(torch.Generator()):
        torch._foreach_add_(tensors, 1.0)
    with guard.around(0):
        torch._foreach_add_(tensors, 1.0)
    assert [t._version for t in tensors] == [3, 3]
    assert torch.equal(tensors[1], torch.full((3,), 3.0))


def test_a_higher_order_operator_runs_under_the_check_before_a_change() -> None:
    """torch refuses a higher-order operator (eager flex_attention) under a dispatch mode that does not declare it
    handles them: the check passes them on, so a model using one runs its first step."""
    from torch.nn.attention.flex_attention import flex_attention

    guard = HandUpdateGuard()
    guard.add(InPlaceWatch([(0, make_model())], consequence="", fix=""))
    guard.begin_step()
    q = torch.randn(1, 1, 8, 4, generator=torch.Generator().manual_seed(0))
    with guard.around(0):
        out = flex_attention(q, q, q)
    torch.testing.assert_close(out, flex_attention(q, q, q), rtol=0, atol=0)
