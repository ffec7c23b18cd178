"""Several models and optimizers in one step under one strategy (a GAN, a frozen teacher, an EMA copy) equal one
device, and `.module` is the plain model under every strategy and replica count."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from cases import TOL, assert_same_state
from conftest import cpu_registry
from several_models_cases import (
    averaged,
    build_distillation,
    build_gan,
    build_routed,
    distillation_step,
    gan_batches,
    gan_step,
    lerp_ema_,
    reference_distillation,
    reference_gan,
    reference_routed,
    reference_token_gan,
    routed_batches,
    routed_step,
    token_gan_batches,
    token_gan_step,
)
from torch import nn

import stratagem as sg

STRATEGIES = {
    "one-device": lambda: sg.OneDeviceStrategy("cpu"),
    "mirrored-1": lambda: sg.MirroredStrategy(["cpu:0"], registry=cpu_registry(3)),
    "mirrored-2": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(3)),
    "mirrored-3": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3)),
    "mirrored-3-copies": lambda: sg.MirroredStrategy(
        ["cpu:0", "cpu:1", "cpu:2"], share_parameters=False, registry=cpu_registry(3)
    ),
    "central-1": lambda: sg.CentralStorageStrategy(["cpu:0"], registry=cpu_registry(3)),
    "central-2": lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(3)),
    "central-3": lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3)),
    "central-2-copies": lambda: sg.CentralStorageStrategy(
        ["cpu:0", "cpu:1"], share_parameters=False, registry=cpu_registry(3)
    ),
}


def _same_values(got: nn.Module, want: nn.Module) -> None:
    for (name, value), (_, expected) in zip(got.state_dict().items(), want.state_dict().items()):
        torch.testing.assert_close(value, expected, **TOL[torch.float64], msg=lambda m, k=name: f"{k}: {m}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_gan_step_with_two_models_and_two_optimizers_equals_one_device(name):
    want_g, want_d, want_ema, want_hand = reference_gan()
    strategy = STRATEGIES[name]()
    try:
        plain_g, plain_d, plain_opt_g, plain_opt_d = build_gan()
        g, opt_g = strategy.distribute(plain_g, plain_opt_g)
        d, opt_d = strategy.distribute(plain_d, plain_opt_d)
        ema, hand = averaged(g), copy.deepcopy(g)  # copies of the plain generator, updated after each step
        assert type(hand) is nn.Sequential
        step = gan_step(g, d, opt_g, opt_d)
        for real, noise in strategy.distribute_dataset(gan_batches()):
            strategy.run(step, args=(real, noise))
            ema.update_parameters(g)
            lerp_ema_(hand, g)
        # Every replica of both models (parameters and BatchNorm running statistics) equals one device's.
        assert_same_state(want_g, g, torch.float64)
        assert_same_state(want_d, d, torch.float64)
        _same_values(ema, want_ema)
        _same_values(hand, want_hand)
        assert opt_d.state_dict()["state"][0]["step"] == len(gan_batches())
    finally:
        strategy.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["one-device", "mirrored-3", "mirrored-3-copies", "central-3"])
def test_a_student_trained_against_a_frozen_teacher_equals_one_device(name):
    want_teacher, want_student = reference_distillation()
    strategy = STRATEGIES[name]()
    try:
        plain_teacher, plain_student, plain_opt = build_distillation()
        teacher = strategy.distribute(plain_teacher)  # no optimizer: never updated
        student, opt = strategy.distribute(plain_student, plain_opt)
        assert not teacher.training and student.training
        step = distillation_step(teacher, student, opt)
        for x, noise in strategy.distribute_dataset(gan_batches()):
            strategy.run(step, args=(x, noise))
        assert_same_state(want_student, student, torch.float64)
        assert_same_state(want_teacher, teacher, torch.float64)  # the teacher's running statistics untouched
    finally:
        strategy.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["mirrored-2", "mirrored-3", "mirrored-3-copies", "central-2", "central-3"])
def test_a_pass_weighted_by_declared_tokens_leaves_the_generators_kept_gradient_bit_for_bit(name):
    # Before each pass combined only what it reached, the discriminator's pass recombined the generator's gradient
    # with the token weights and divided it by their total: equal up to rounding (1e-17 here), not bit for bit.
    want_g, want_d = reference_token_gan()
    strategy = STRATEGIES[name]()
    try:
        plain_g, plain_d, plain_opt_g, plain_opt_d = build_gan()
        g, opt_g = strategy.distribute(plain_g, plain_opt_g)
        d, opt_d = strategy.distribute(plain_d, plain_opt_d)
        step = token_gan_step(g, d, opt_g, opt_d, declare=sg.set_loss_weight)
        changes = [strategy.run(step, args=batch) for batch in strategy.distribute_dataset(token_gan_batches())]
        assert [float(c) for change in changes for c in change.values] == [0.0] * len(changes) * len(g.replicas)
        assert_same_state(want_g, g, torch.float64)
        assert_same_state(want_d, d, torch.float64)
    finally:
        strategy.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["mirrored-2", "mirrored-3", "mirrored-3-copies", "central-2", "central-3"])
def test_a_pass_that_reaches_a_parameter_on_some_replicas_only_equals_one_device(name):
    want = reference_routed()
    strategy = STRATEGIES[name]()
    try:
        net, opt = strategy.distribute(*build_routed())
        step = routed_step(net, opt)
        for x, y in strategy.distribute_dataset(routed_batches()):
            strategy.run(step, args=(x, y))
        assert_same_state(want, net, torch.float64)
    finally:
        strategy.close()


@pytest.mark.parametrize("name", ["mirrored-2", "mirrored-3", "central-3"])
def test_a_pass_whose_loss_weights_add_up_to_zero_leaves_what_it_did_not_reach(name):
    # Without a token anywhere the pass divides by nothing; before, it multiplied the first model's gradient,
    # which it never reached, by the weights 0 and left it at zero.
    torch.manual_seed(4)
    first, second = nn.Linear(3, 2).double(), nn.Linear(3, 1).double()
    x = torch.randn(6, 3, dtype=torch.float64)
    first(x).pow(2).mean().backward()
    want = first.weight.grad.clone()
    first.zero_grad()
    strategy = STRATEGIES[name]()
    try:
        a, b = strategy.distribute(first), strategy.distribute(second)

        def step(x):
            a(x).pow(2).mean().backward()
            sg.set_loss_weight(0)  # nothing to average over: the loss is 0
            (b(x).sum() * 0).backward()

        for batch in strategy.distribute_dataset([(x,)]):
            strategy.run(step, args=batch)
        for replica in a.replicas:
            torch.testing.assert_close(replica.weight.grad, want, **TOL[torch.float64])
    finally:
        strategy.close()


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_module_is_the_plain_model_under_every_in_process_strategy(name):
    strategy = STRATEGIES[name]()
    try:
        net = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
        model, _ = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1))
        assert type(model.module) is nn.Sequential
        assert model.module[0].weight.shape == (2, 3)  # attribute access reaches the plain model
        assert model[0].out_features == 2  # and through the distributed model itself
        assert model.to("cpu") is model  # a script's .to(device) where the replicas already are changes nothing
        seen = []

        def step(x):
            seen.append(type(model.module))
            return model(x).sum()

        strategy.run(step, args=(torch.ones(4, 3),))
        assert set(seen) == {nn.Sequential}
        assert type(pickle.loads(pickle.dumps(model))) is nn.Sequential
    finally:
        strategy.close()


def test_a_scheduler_is_handed_the_optimizer_it_adjusts_among_several():
    strategy = STRATEGIES["mirrored-2"]()
    try:
        _, _, plain_opt_g, plain_opt_d = plain = build_gan()
        g, opt_g = strategy.distribute(plain[0], plain_opt_g)
        d, opt_d = strategy.distribute(plain[1], plain_opt_d)
        scheduler = strategy.distribute_scheduler(torch.optim.lr_scheduler.StepLR(plain_opt_d, 1, gamma=0.5))

        def step(real, noise):
            gan_step(g, d, opt_g, opt_d)(real, noise)
            scheduler.step()

        for real, noise in strategy.distribute_dataset(gan_batches()[:2]):
            strategy.run(step, args=(real, noise))
        assert opt_d.param_groups[0]["lr"] == pytest.approx(0.02 * 0.25)
        assert opt_g.param_groups[0]["lr"] == pytest.approx(0.01)
    finally:
        strategy.close()


def test_distribute_inside_a_step_is_refused():
    strategy = STRATEGIES["mirrored-2"]()
    try:
        strategy.distribute(nn.Linear(2, 1))
        with pytest.raises(sg.InputError, match=r"distribute\(\) was called inside strategy.run\(\)"):
            strategy.run(lambda: strategy.distribute(nn.Linear(2, 1)))
    finally:
        strategy.close()


def test_each_replicas_random_stream_is_seeded_at_the_first_distribute_only(monkeypatch):
    from stratagem.strategies.data_parallel import cuda_numerics

    calls = []
    monkeypatch.setattr(cuda_numerics, "seed_replica_streams", lambda devices, first: calls.append(first))
    strategy = STRATEGIES["mirrored-2"]()
    try:
        strategy.distribute(nn.Linear(2, 1))
        strategy.distribute(nn.Linear(2, 1))  # a second model must not restart the streams the first one began
        assert calls == [0]
    finally:
        strategy.close()


def test_fit_trains_a_model_that_was_not_the_first_one_distributed():
    torch.manual_seed(3)
    teacher, net = nn.Linear(4, 2).double(), nn.Linear(4, 2).double()
    reference = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 2, (6,))
    ref_opt.zero_grad()
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    ref_opt.step()
    strategy = STRATEGIES["mirrored-2"]()
    try:
        strategy.distribute(teacher)
        model, opt = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1))
        history = sg.fit(strategy, model, opt, torch.nn.functional.cross_entropy, [(x, y)], shuffle=False)
        assert history.model is model
        assert_same_state(reference, model, torch.float64)
    finally:
        strategy.close()
