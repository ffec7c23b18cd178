"""Every torch.optim optimizer (and a user's own) under Mirrored and CentralStorage: the parameters
of one device, replicas that never share a state tensor, and state_dict() round trips.

Each optimizer is built with two parameter groups carrying different options, so the copies
made for other replicas must keep per-group settings, not only the optimizer's defaults.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from cases import BATCH_SIZES, TOL, assert_same_state, make_batches, mlp, train_reference, train_with
from conftest import cpu_registry
from helpers import launch_workers
from optimizer_cases import build_heads, heads_loss
from torch import nn

import stratagem as sg

SIZES = [12, 7, 5, 2]  # uneven over 2 and 3 replicas; the last smaller than 3


class OwnMomentum(torch.optim.Optimizer):
    """A user's optimizer whose __init__ takes other arguments than its defaults (`scale`, not `lr`)
    and keeps a field of its own beside the groups."""

    def __init__(self, params, scale: float = 1.0, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": 0.05 * scale, "beta": beta})
        self.steps_taken = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.steps_taken += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "avg" not in state:
                    state["avg"] = torch.zeros_like(p)
                state["avg"].mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.add_(state["avg"], alpha=-group["lr"])


def _groups(model: nn.Module, **first) -> list[dict]:
    """Two groups: the first layer with options of its own, the rest with the optimizer's."""
    params = list(model.parameters())
    return [{"params": params[:2], **first}, {"params": params[2:]}]


optim = torch.optim
OPTIMIZERS = {
    "sgd_momentum": lambda m: optim.SGD(_groups(m, lr=0.05, momentum=0.5), lr=0.1, momentum=0.9, weight_decay=1e-3),
    "sgd_nesterov": lambda m: optim.SGD(
        _groups(m, weight_decay=0.0), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3
    ),
    "adam_amsgrad": lambda m: optim.Adam(_groups(m, lr=0.02), lr=0.01, amsgrad=True),
    "adamw": lambda m: optim.AdamW(_groups(m, weight_decay=0.0), lr=0.01, weight_decay=0.1),
    "radam": lambda m: optim.RAdam(_groups(m, lr=0.02), lr=0.01),
    "nadam": lambda m: optim.NAdam(_groups(m, lr=0.02), lr=0.01),
    "adamax": lambda m: optim.Adamax(_groups(m, lr=0.01), lr=0.02),
    "adagrad": lambda m: optim.Adagrad(_groups(m, lr=0.05), lr=0.1, lr_decay=0.01),
    "adadelta": lambda m: optim.Adadelta(_groups(m, rho=0.8), lr=1.0),
    "rmsprop": lambda m: optim.RMSprop(_groups(m, centered=True), lr=0.01, momentum=0.5),
    "rprop": lambda m: optim.Rprop(_groups(m, lr=0.02), lr=0.01),
    "asgd": lambda m: optim.ASGD(_groups(m, lr=0.02), lr=0.05, t0=2),
    "own_subclass": lambda m: OwnMomentum(_groups(m, beta=0.5), scale=2.0),
}


def _mirrored(n: int, share):
    return lambda: sg.MirroredStrategy([f"cpu:{i}" for i in range(n)], share_parameters=share, registry=cpu_registry(n))


STRATEGIES = {
    "mirrored2": _mirrored(2, None),
    "mirrored2-private": _mirrored(2, False),
    "mirrored3": _mirrored(3, None),
    "mirrored3-private": _mirrored(3, False),
    "central2": lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2)),
}


def _fresh(opt_name: str):
    torch.manual_seed(42)
    model = mlp().double()
    return model, OPTIMIZERS[opt_name](model)


@pytest.mark.parametrize("strategy_name", list(STRATEGIES))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_every_optimizer_matches_one_device(opt_name, strategy_name):
    batches = make_batches((6,), torch.float64, sizes=SIZES)
    reference, ref_opt = _fresh(opt_name)
    train_reference(reference, ref_opt, batches)
    model, optimizer = _fresh(opt_name)
    model, optimizer, _ = train_with(STRATEGIES[strategy_name](), model, optimizer, batches)
    assert_same_state(reference, model, torch.float64)
    # The optimizer's state matches one device's too (what a checkpoint would hold).
    expected, got = ref_opt.state_dict(), optimizer.state_dict()
    assert got["state"].keys() == expected["state"].keys()
    for i, entry in expected["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(
                torch.as_tensor(got["state"][i][key]), torch.as_tensor(value), **TOL[torch.float64], check_dtype=False
            )
    for mine, theirs in zip(got["param_groups"], expected["param_groups"]):
        assert {k: v for k, v in mine.items()} == {k: v for k, v in theirs.items()}


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]


def _replica_optimizers(distributed) -> list[torch.optim.Optimizer]:
    return list(distributed._optimizers)


@pytest.mark.parametrize("share", [None, False], ids=["shared", "private"])
@pytest.mark.parametrize("opt_name", ["adagrad", "adam_amsgrad", "own_subclass"])
def test_replicas_never_share_a_state_tensor_even_after_load_state_dict(opt_name, share):
    # Adagrad builds its state in __init__ (state["sum"]); the others at their first step.
    batches = make_batches((6,), torch.float64, sizes=SIZES[:2])
    model, optimizer = _fresh(opt_name)
    strategy = _mirrored(3, share)()
    model, optimizer, _ = train_with(strategy, model, optimizer, batches)
    optimizer.load_state_dict(optimizer.state_dict())  # a resumed optimizer
    pointers = [
        {t.untyped_storage().data_ptr() for t in _state_tensors(o) if t.numel()} for o in _replica_optimizers(optimizer)
    ]
    assert all(pointers), "every replica holds state"
    for r, mine in enumerate(pointers):
        for k, theirs in enumerate(pointers[r + 1 :], start=r + 1):
            assert not mine & theirs, f"replicas {r} and {k} share a state tensor"


@pytest.mark.parametrize("strategy_name", ["mirrored2", "mirrored2-private", "mirrored3-private", "central2"])
@pytest.mark.parametrize("opt_name", ["adagrad", "adam_amsgrad", "own_subclass"])
def test_state_dict_round_trips_through_a_plain_optimizer_and_resumes_as_one_device(opt_name, strategy_name):
    batches = make_batches((6,), torch.float64, sizes=SIZES)
    reference, ref_opt = _fresh(opt_name)
    train_reference(reference, ref_opt, batches)

    model, optimizer = _fresh(opt_name)
    model, optimizer, _ = train_with(STRATEGIES[strategy_name](), model, optimizer, batches[:2])
    # Into a plain optimizer (the checkpoint format of one device) ...
    plain_model, plain_opt = _fresh(opt_name)
    plain_model.load_state_dict(model.state_dict())
    plain_opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    # ... and back, through the distributed optimizer's load_state_dict (a resumed run).
    resumed_model, resumed_opt = _fresh(opt_name)
    resumed_model.load_state_dict(plain_model.state_dict())
    strategy = STRATEGIES[strategy_name]()
    resumed_model, resumed_opt = strategy.distribute(resumed_model, resumed_opt)
    resumed_opt.load_state_dict(copy.deepcopy(plain_opt.state_dict()))

    def step(x, y):
        F.cross_entropy(resumed_model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(resumed_model.parameters(), 1.0)
        resumed_opt.step()
        resumed_opt.zero_grad()

    for x, y in strategy.distribute_dataset(batches[2:]):
        strategy.run(step, args=(x, y))
    assert_same_state(reference, resumed_model, torch.float64)


def test_a_subclass_keeps_its_own_fields_on_every_replica():
    model, optimizer = _fresh("own_subclass")
    strategy = _mirrored(2, None)()
    model, optimizer, _ = train_with(strategy, model, optimizer, make_batches((6,), torch.float64, sizes=SIZES))
    assert [o.steps_taken for o in optimizer._optimizers] == [len(SIZES)] * 2
    assert strategy.explain().decision("parameter storage").choice == "a private copy per replica"


@pytest.mark.parametrize("strategy_name", ["mirrored2", "mirrored2-private", "central2"])
def test_lbfgs_is_refused_at_distribute_with_the_reason(strategy_name):
    model = mlp().double()
    with pytest.raises(
        sg.InputError,
        match=r"cannot train with LBFGS over 2 replicas: LBFGS re-evaluates the loss "
        r".* Received: LBFGS with 2 replicas in sync\. Train with LBFGS on one device",
    ):
        STRATEGIES[strategy_name]().distribute(model, torch.optim.LBFGS(model.parameters()))


def test_lbfgs_with_its_closure_works_on_one_replica():
    batches = make_batches((6,), torch.float64, sizes=SIZES)

    def train(model, optimizer, run=lambda fn, x, y: fn(x, y)):
        def step(x, y):
            def closure():
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                return loss

            optimizer.step(closure)

        for x, y in batches:
            run(step, x, y)

    torch.manual_seed(42)
    reference = mlp().double()
    model = copy.deepcopy(reference)
    train(reference, torch.optim.LBFGS(reference.parameters(), lr=0.5, max_iter=3))
    strategy = sg.MirroredStrategy(["cpu:0"], registry=cpu_registry(1))
    model, optimizer = strategy.distribute(model, torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3))
    train(model, optimizer, run=lambda fn, x, y: strategy.run(fn, args=(x, y)))
    assert_same_state(reference, model, torch.float64)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_every_optimizer_and_a_scheduler_match_one_device_across_two_workers(tmp_path):
    # One launch for all (processes are slow to start): every torch.optim first-order optimizer drives one
    # head of the model through a user's Optimizer subclass, copied for each worker's second local replica,
    # with a LambdaLR stepped in the step function by every replica.
    out = tmp_path / "result.pt"
    exit_code, output = launch_workers(
        "mwms_optimizers.py", {"MW_OUT": str(out), "MW_LOCAL": "2"}, timeout=120, tail=30
    )
    assert exit_code == 0, output
    saved = torch.load(out)
    reference, optimizer = build_heads()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0 / (1 + epoch))
    for x, y in make_batches((6,), torch.float64):
        heads_loss(reference(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    assert "4 replica(s) in sync" in saved["explain"]
    assert saved["last_epoch"] == scheduler.last_epoch == len(BATCH_SIZES)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(saved["state"][key], value, **TOL[torch.float64])


class KeepsALock(torch.optim.SGD):
    """A user's optimizer that says through `__getstate__`/`__setstate__` what a copy holds: its lock cannot be
    copied, so a copy (deepcopy, pickle) gets a new one; its `scale` travels."""

    def __init__(self, params, lr: float, scale: float) -> None:
        super().__init__(params, lr=lr)
        self.scale = scale
        self.lock = threading.Lock()

    def __getstate__(self):
        return {**super().__getstate__(), "scale": self.scale}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.lock = threading.Lock()

    @torch.no_grad()
    def step(self, closure=None):
        with self.lock:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"] * self.scale)


def test_replicas_copy_the_users_optimizer_through_its_own_copy_protocol():
    # The copies are made by copy.deepcopy: the class's __getstate__/__setstate__ decide what they hold (a lock is
    # made anew), and no copy shares the user's lock.
    batches = make_batches((6,), torch.float64, sizes=SIZES)
    torch.manual_seed(42)
    reference = mlp().double()
    model = copy.deepcopy(reference)
    # The plain one-device update of KeepsALock is SGD at lr * scale.
    train_reference(reference, torch.optim.SGD(reference.parameters(), lr=0.1 * 0.5), batches)
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], share_parameters=False, registry=cpu_registry(2))
    users = KeepsALock(model.parameters(), lr=0.1, scale=0.5)
    model, optimizer, _ = train_with(strategy, model, users, batches)
    assert_same_state(reference, model, torch.float64)
    copies = optimizer._optimizers[1:]
    assert copies and all(type(c) is KeepsALock and c.scale == 0.5 and c.lock is not users.lock for c in copies)
    strategy.close()
