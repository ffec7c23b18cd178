"""The backbone: synchronous strategies give the parameters of one device trained on the same global batches.

Every case trains K steps with a plain PyTorch loop on one device and with the strategy, on the same
global batches (uneven splits, a last short batch, a batch smaller than the replica count), with
gradient clipping between backward and step, and compares every parameter and optimizer state.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from cases import (
    MODELS,
    OPTIMIZERS,
    TOL,
    assert_same_state,
    build,
    make_batches,
    mlp,
    train_reference,
    train_with,
)
from conftest import cpu_registry

import stratagem as sg


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize(
    "num_replicas,share",
    [(1, None), (2, None), (3, None), (2, False), (3, False)],
    ids=["1", "2-shared", "3-shared", "2-copies", "3-copies"],
)
def test_mirrored_matches_one_device(num_replicas, share, model_name, opt_name, dtype):
    reference, ref_opt, shape = build(model_name, opt_name, dtype)
    model, opt, _ = build(model_name, opt_name, dtype)
    batches = make_batches(shape, dtype)
    train_reference(reference, ref_opt, batches)

    strategy = sg.MirroredStrategy(
        [f"cpu:{i}" for i in range(num_replicas)], share_parameters=share, registry=cpu_registry(3)
    )
    model, opt, _ = train_with(strategy, model, opt, batches)

    assert_same_state(reference, model, dtype)
    ref_state = ref_opt.state_dict()["state"]
    per_replica = [opt] if share is None else getattr(opt, "_optimizers", [opt])
    for replica_opt in per_replica:
        got_state = replica_opt.state_dict()["state"]
        for index, entries in ref_state.items():
            for name, value in entries.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    torch.testing.assert_close(got_state[index][name], value, **TOL[dtype])


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_one_device_matches_plain_loop(model_name, opt_name):
    reference, ref_opt, shape = build(model_name, opt_name, torch.float64)
    model, opt, _ = build(model_name, opt_name, torch.float64)
    batches = make_batches(shape, torch.float64)
    train_reference(reference, ref_opt, batches)
    model, opt, _ = train_with(sg.OneDeviceStrategy("cpu"), model, opt, batches)
    assert_same_state(reference, model, torch.float64)


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_mean_loss_equals_global_batch_loss(num_replicas):
    """reduce('mean') of per-replica mean losses is the mean loss over the global batch, uneven splits included."""
    model, _, shape = build("mlp", "sgd_momentum", torch.float64)
    reference = copy.deepcopy(model)
    batches = make_batches(shape, torch.float64, sizes=[7, 2])
    strategy = sg.MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)], registry=cpu_registry(3))
    dist_model = strategy.distribute(model)
    for (x, y), dist in zip(batches, strategy.distribute_dataset(batches)):
        expected = F.cross_entropy(reference(x), y)
        got = strategy.reduce("mean", strategy.run(lambda a, b: F.cross_entropy(dist_model(a), b), args=dist))
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_weighting_is_what_makes_uneven_splits_exact():
    """Averaging the two replicas' gradients equally (DDP's rule) would differ from one device on a 3/1 split."""
    model, _, shape = build("mlp", "sgd_momentum", torch.float64)
    ((x, y),) = make_batches(shape, torch.float64, sizes=[4])
    x, y = x[:4], y[:4]
    full = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    g_a = torch.autograd.grad(F.cross_entropy(model(x[:3]), y[:3]), list(model.parameters()))
    g_b = torch.autograd.grad(F.cross_entropy(model(x[3:]), y[3:]), list(model.parameters()))
    equal = [(a + b) / 2 for a, b in zip(g_a, g_b)]
    weighted = [0.75 * a + 0.25 * b for a, b in zip(g_a, g_b)]
    assert not torch.allclose(equal[0], full[0])
    torch.testing.assert_close(weighted[0], full[0], rtol=1e-12, atol=1e-12)

    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    dist_model = strategy.distribute(copy.deepcopy(model))
    # 3 examples for replica 0 and 1 for replica 1 is not an even split, so build it by hand.
    xs = sg.PerReplica((x[:3], x[3:]), batch_sizes=(3, 1))
    ys = sg.PerReplica((y[:3], y[3:]), batch_sizes=(3, 1))

    def grads(a, b):
        F.cross_entropy(dist_model(a), b).backward()
        return [p.grad.clone() for p in dist_model.parameters()]

    per_parameter = strategy.run(grads, args=(xs, ys))  # a list result: one PerReplica per list element
    for per_replica, want in zip(per_parameter, full):
        for got in strategy.experimental_local_results(per_replica):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_two_backward_passes_per_step_accumulate_like_one_device():
    """Gradient accumulation (two backward() calls before step) stays exact: the combination is linear."""
    model, opt, shape = build("mlp", "sgd_momentum", torch.float64)
    reference = copy.deepcopy(model)
    ref_opt = OPTIMIZERS["sgd_momentum"](reference.parameters())
    first, second = make_batches(shape, torch.float64, sizes=[9, 5])
    (F.cross_entropy(reference(first[0]), first[1]) * 0.5).backward()
    (F.cross_entropy(reference(second[0]), second[1]) * 0.5).backward()
    ref_opt.step()

    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3))
    dist_model, dist_opt = strategy.distribute(model, opt)
    a, b = list(strategy.distribute_dataset([first, second]))

    def backward_only(x, y):
        (F.cross_entropy(dist_model(x), y) * 0.5).backward()

    strategy.run(backward_only, args=a)
    strategy.run(backward_only, args=b)
    strategy.run(lambda: dist_opt.step())
    assert_same_state(reference, dist_model, torch.float64)


def test_shared_parameters_keep_one_copy_and_one_optimizer_state():
    model, opt, shape = build("mlp", "adam", torch.float64)
    numel = sum(p.numel() for p in model.parameters())
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3))
    model, opt, _ = train_with(strategy, model, opt, make_batches(shape, torch.float64))
    assert strategy.explain().decision("parameter storage").choice == "shared, update sharded"
    first, *others = model.replicas
    for replica in others:
        for p, q in zip(first.parameters(), replica.parameters()):
            assert p.data_ptr() == q.data_ptr()
    shard_state = sum(
        t.numel() for o in opt._optimizers for entry in o.state.values() for k, t in entry.items() if k == "exp_avg"
    )
    assert shard_state == numel  # each element's moment exists once, across all replicas


def test_shards_use_fused_kernels_where_the_user_left_the_choice_to_torch():
    """The shards' parameter groups, which override the defaults, say fused too; state_dict keeps the user's flags."""
    model, opt, _ = build("mlp", "sgd_momentum", torch.float64)
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    _, dist_opt = strategy.distribute(model, opt)
    assert [group["fused"] for shard in dist_opt._optimizers for group in shard.param_groups] == [True, True]
    assert dist_opt.state_dict()["param_groups"][0]["fused"] is None
    strategy.close()


def test_sharded_optimizer_state_dict_round_trips_into_a_plain_optimizer():
    """A checkpoint of the sharded optimizer loads into the plain optimizer (and back) unchanged."""
    model, opt, shape = build("mlp", "sgd_momentum", torch.float64)
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    _, dist_opt, _ = train_with(strategy, model, opt, make_batches(shape, torch.float64))
    reference, ref_opt, _ = build("mlp", "sgd_momentum", torch.float64)
    train_reference(reference, ref_opt, make_batches(shape, torch.float64))
    plain = OPTIMIZERS["sgd_momentum"](reference.parameters())
    plain.load_state_dict(dist_opt.state_dict())
    assert not plain.param_groups[0]["fused"]  # the shards' faster kernels do not leak into a checkpoint
    for a, b in zip(plain.state_dict()["state"].values(), ref_opt.state_dict()["state"].values()):
        torch.testing.assert_close(a["momentum_buffer"], b["momentum_buffer"], **TOL[torch.float64])
    dist_opt.load_state_dict(ref_opt.state_dict())
    for a, b in zip(dist_opt.state_dict()["state"].values(), ref_opt.state_dict()["state"].values()):
        torch.testing.assert_close(a["momentum_buffer"], b["momentum_buffer"], rtol=0, atol=0)


def test_sharded_adam_resumes_exactly_from_a_loaded_state_dict():
    """A checkpoint loaded into the sharded optimizer resumes Adam exactly: each shard keeps its own step
    count (a step tensor shared by the shards would be counted once per replica after the load)."""
    reference, ref_opt, shape = build("mlp", "adam", torch.float64)
    batches = make_batches(shape, torch.float64)
    train_reference(reference, ref_opt, batches[:2])
    model, opt, _ = build("mlp", "adam", torch.float64)
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    dist_model, dist_opt = strategy.distribute(model, opt)
    dist_model.load_state_dict(reference.state_dict())
    dist_opt.load_state_dict(ref_opt.state_dict())

    def step(x, y):
        F.cross_entropy(dist_model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(dist_model.parameters(), 1.0)
        dist_opt.step()
        dist_opt.zero_grad()

    for x, y in strategy.distribute_dataset(batches[2:]):
        strategy.run(step, args=(x, y))
    train_reference(reference, ref_opt, batches[2:])
    assert_same_state(reference, dist_model, torch.float64)


class _OwnSGD(torch.optim.SGD):
    """A subclass: it may change the arithmetic, so it is not known to be elementwise."""


def test_non_elementwise_optimizer_keeps_private_copies_and_says_why():
    net = mlp().double()
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    strategy.distribute(net, _OwnSGD(net.parameters(), lr=0.1))
    decision = strategy.explain().decision("parameter storage")
    assert decision.choice == "a private copy per replica"
    assert "_OwnSGD is not known to update each element independently" in decision.reason
    strict = sg.MirroredStrategy(["cpu:0", "cpu:1"], share_parameters=True, registry=cpu_registry(2))
    other = mlp().double()
    with pytest.raises(sg.InputError, match="share_parameters=True, but the replicas cannot share parameters: _OwnSGD"):
        strict.distribute(other, _OwnSGD(other.parameters(), lr=0.1))


@pytest.mark.parametrize(
    "make_optimizer",
    [lambda ps: torch.optim.Rprop(ps, lr=0.01), lambda ps: torch.optim.ASGD(ps, lr=0.05, t0=2)],
    ids=["rprop", "asgd"],
)
def test_rprop_and_asgd_share_parameters_and_match_one_device(make_optimizer):
    # ASGD's shards keep torch's default kernel: its foreach kernel rounds differently (1.5e-9 in float64).
    torch.manual_seed(42)
    reference = mlp().double()
    model = copy.deepcopy(reference)
    ref_opt = make_optimizer(reference.parameters())
    batches = make_batches((6,), torch.float64)
    train_reference(reference, ref_opt, batches)
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    model, _, _ = train_with(strategy, model, make_optimizer(model.parameters()), batches)
    assert strategy.explain().decision("parameter storage").choice == "shared, update sharded"
    assert_same_state(reference, model, torch.float64)


class _SlowBackwardOnReplica1(torch.autograd.Function):
    """Identity whose backward pauses in replica 1 only, so replica 0 finishes backward first."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        from stratagem.strategies.replica_context import current_replica_context

        context = current_replica_context()
        if context is not None and context.replica_id_in_sync_group == 1:
            time.sleep(0.2)
        return grad


class _Pause(torch.nn.Module):
    def forward(self, x):
        return _SlowBackwardOnReplica1.apply(x)


def test_a_replica_waiting_at_the_end_of_backward_combines_gradients_the_others_have_ready_exactly(monkeypatch):
    """Replica 0 waits while replica 1 pauses before the first layer's gradient; meanwhile it combines
    both shares of the later layers' gradients. The result still equals one device (uneven splits)."""
    from stratagem.strategies.data_parallel import replica_set

    monkeypatch.setattr(replica_set, "STEAL_MIN_ELEMENTS", 1)  # these layers are tiny: let every share be claimed

    def model_with_pause():
        torch.manual_seed(42)
        return torch.nn.Sequential(
            torch.nn.Linear(6, 16),
            _Pause(),
            torch.nn.ReLU(),
            torch.nn.Linear(16, 16),
            torch.nn.Tanh(),
            torch.nn.Linear(16, 4),
        ).to(torch.float64)

    reference = model_with_pause()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    batches = make_batches((6,), torch.float64)
    train_reference(reference, ref_opt, batches)

    model = model_with_pause()
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    model, _, _ = train_with(strategy, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), batches)

    assert_same_state(reference, model, torch.float64)
    # Parameters 2-5 (the last two layers) were ready in both replicas while replica 0 waited: both of
    # their shares were combined then, in the one backward pass of the last step.
    assert [strategy._replicas.combination.claimed[i] for i in range(2, 6)] == [[1, 1]] * 4
    strategy.close()


def test_small_gradients_are_left_for_the_combination_after_the_meeting():
    """A share of a small gradient costs more Python than it saves: with the default threshold, nothing
    of these tiny layers is claimed early, and the result is the same."""
    torch.manual_seed(42)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), _Pause(), torch.nn.ReLU(), torch.nn.Linear(16, 4)).double()
    reference = copy.deepcopy(model)
    batches = make_batches((6,), torch.float64)
    train_reference(reference, torch.optim.SGD(reference.parameters(), lr=0.1), batches)
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    model, _, _ = train_with(strategy, model, torch.optim.SGD(model.parameters(), lr=0.1), batches)
    assert_same_state(reference, model, torch.float64)
    combination = strategy._replicas.combination
    assert combination.stealable == [False] * 4 and all(c == [0, 0] for c in combination.claimed)
    strategy.close()
