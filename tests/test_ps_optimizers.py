"""A parameter server applies the very optimizer the user built: built again from its spec, never by calling
the class with the groups, so a subclass whose __init__ takes other arguments trains as it does on one device."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from cases import TOL, build, make_batches, train_reference

from stratagem.errors import InputError
from stratagem.strategies.parameter_server.optimizers import build_optimizer, hypers_of, optimizer_spec
from stratagem.strategies.parameter_server.partitioners import FixedShardsPartitioner, place
from stratagem.strategies.parameter_server.server import ParameterServer
from stratagem.strategies.parameter_server.transport import Security
from stratagem.strategies.parameter_server.variables import ShardedVariables

SECURITY = Security(token="optimizers-test")


class ScaledSGD(torch.optim.SGD):
    """SGD on gradients scaled by ``scale``: an ``__init__`` argument that is not a hyper-parameter of the groups,
    so ``ScaledSGD(param_groups)`` cannot be called."""

    def __init__(self, params, scale: float, *, lr: float) -> None:
        super().__init__(params, lr=lr, momentum=0.9)
        self.scale = scale

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(self.scale)
        return super().step(closure)


OPTIMIZERS = {
    # AdamW keeps decoupled_weight_decay in its groups and defaults only, not as an __init__ argument.
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.5),
    "user_subclass": lambda params: ScaledSGD(params, 0.25, lr=0.1),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_servers_apply_the_users_optimizer_as_one_device_does(name):
    model, _, shape = build("mlp", "sgd_momentum", torch.float64)
    reference = copy.deepcopy(model)
    batches = make_batches(shape, torch.float64)
    train_reference(reference, OPTIMIZERS[name](reference.parameters()), batches)

    optimizer = OPTIMIZERS[name](model.parameters())
    servers = [ParameterServer(security=SECURITY, task=f"ps:{i}") for i in range(2)]
    shards = place([(n, p, 0) for n, p in model.named_parameters()], 2, FixedShardsPartitioner(2))
    variables = ShardedVariables(
        shards, [ps.address for ps in servers], security=SECURITY, rpc_timeout=20, shared_memory=False
    )
    try:
        variables.create(dict(model.named_parameters()), optimizer)
        params = dict(model.named_parameters())
        for x, y in batches:  # one worker pushing in turn: the updates of one device, one after another
            variables.pull_into(params)
            F.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            variables.push({n: p.grad for n, p in params.items()})
            model.zero_grad()
        variables.pull_into(params)
    finally:
        variables.close()
        for ps in servers:
            ps.stop()
    for (key, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, **TOL[torch.float64], msg=lambda m, k=key: f"{k}: {m}")


def test_an_optimizer_attribute_that_json_cannot_carry_is_refused_before_any_work():
    optimizer = ScaledSGD([torch.nn.Parameter(torch.zeros(2))], 0.5, lr=0.1)
    optimizer.scale = torch.ones(3)  # a tensor of several values: no plain number to send
    with pytest.raises(
        InputError,
        match=r"An optimizer attribute cannot be sent to the parameter servers\. "
        r"Received: ScaledSGD\.scale=tensor\(\[1\., 1\., 1\.\]\)\. Keep numbers, booleans",
    ):
        optimizer_spec(optimizer)


def test_lbfgs_is_refused_by_name_not_by_its_attributes():
    optimizer = torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(
        InputError,
        match=r"cannot apply LBFGS: its step re-evaluates the loss through a closure.*"
        r"Received: LBFGS\. Choose a first-order optimizer",
    ):
        optimizer_spec(optimizer)


class KnowsItWasRestored(torch.optim.SGD):
    """A user's optimizer whose `__setstate__` (what torch.load and copy.deepcopy call) marks the copy."""

    def __setstate__(self, state):
        super().__setstate__(state)
        self.restored = True


def test_a_server_rebuilds_the_optimizer_as_unpickling_does():
    # The server calls the class's own __setstate__ (never its __init__, whose signature is the class's business).
    w = torch.nn.Parameter(torch.ones(2))
    chief = KnowsItWasRestored([w], lr=0.3)
    spec = optimizer_spec(chief)
    shard = torch.nn.Parameter(torch.ones(1))
    rebuilt = build_optimizer(KnowsItWasRestored, [{"params": [shard], **hypers_of(spec)[0]}], spec)
    assert not hasattr(chief, "restored") and type(rebuilt) is KnowsItWasRestored and rebuilt.restored
    assert rebuilt.param_groups[0]["params"] == [shard] and rebuilt.param_groups[0]["lr"] == 0.3
    assert rebuilt.defaults == chief.defaults
    shard.grad = torch.full((1,), 2.0)
    rebuilt.step()
    assert shard.item() == pytest.approx(1 - 0.3 * 2)  # torch's SGD step over the server's shard
