"""Parameter servers apply the user's optimizer to their shards; checkpoints keep variables and optimizer state."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from cases import TOL, build, make_batches, train_reference

from stratagem.errors import ParameterServerError
from stratagem.strategies.parameter_server.partitioners import (
    FixedShardsPartitioner,
    place,
)
from stratagem.strategies.parameter_server.server import (
    ParameterServer,
    resolve_optimizer_class,
)
from stratagem.strategies.parameter_server.transport import Security
from stratagem.strategies.parameter_server.variables import ShardedVariables

SECURITY = Security(token="service-test")


@pytest.fixture
def servers():
    started = [ParameterServer(security=SECURITY, task=f"ps:{i}") for i in range(2)]
    yield started
    for ps in started:
        ps.stop()


def _variables(model, optimizer, servers, partitioner):
    groups = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    shards = place([(n, p, groups[id(p)]) for n, p in model.named_parameters()], len(servers), partitioner)
    return ShardedVariables(shards, [ps.address for ps in servers], security=SECURITY, rpc_timeout=20)


def _train(variables, model, batches):
    params = dict(model.named_parameters())
    for x, y in batches:
        variables.pull_into(params)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        variables.push({n: p.grad for n, p in params.items()})
        model.zero_grad()
    variables.pull_into(params)


def _assert_close(a, b, dtype):
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(x, y, **TOL[dtype], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam"])
def test_one_worker_pushing_in_turn_equals_plain_training(servers, opt_name):
    model, optimizer, shape = build("mlp", opt_name, torch.float64)
    reference = copy.deepcopy(model)
    ref_opt = type(optimizer)(reference.parameters(), **optimizer.defaults)
    batches = make_batches(shape, torch.float64)
    train_reference(reference, ref_opt, batches)

    variables = _variables(model, optimizer, servers, FixedShardsPartitioner(3))
    assert {s.ps for s in variables.shards} == {0, 1}
    variables.create(dict(model.named_parameters()), optimizer)
    worker_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in worker_model.parameters():
            p.zero_()  # the worker's copy starts wrong: every value it uses must come from a pull
    _train(variables, worker_model, batches)
    _assert_close(worker_model, reference, torch.float64)
    variables.close()


@pytest.mark.timeout(60)
def test_checkpoint_restores_variables_and_optimizer_state_under_another_placement(servers, tmp_path):
    model, optimizer, shape = build("mlp", "adam", torch.float64)
    batches = make_batches(shape, torch.float64)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    train_reference(reference, ref_opt, batches)

    first = _variables(model, optimizer, servers, FixedShardsPartitioner(2))
    first.create(dict(model.named_parameters()), optimizer)
    worker = copy.deepcopy(model)
    _train(first, worker, batches[:3])
    first.save(tmp_path / "ckpt.pt")
    first.close()

    # A new job: fresh servers, other placement (no partitioner); state restored from the file.
    fresh = [ParameterServer(security=SECURITY, task=f"ps:{i}") for i in range(3)]
    try:
        torch.manual_seed(7)
        restarted_model, restarted_opt, _ = build("mlp", "adam", torch.float64)
        second = _variables(restarted_model, restarted_opt, fresh, None)
        second.create(dict(restarted_model.named_parameters()), restarted_opt)
        second.restore(tmp_path / "ckpt.pt")
        _train(second, restarted_model, batches[3:])
        _assert_close(restarted_model, reference, torch.float64)  # Adam moments and step counts came back too
        second.close()
    finally:
        for ps in fresh:
            ps.stop()


def test_restore_refuses_a_foreign_file(servers, tmp_path):
    model, optimizer, _ = build("mlp", "sgd_momentum", torch.float32)
    variables = _variables(model, optimizer, servers, None)
    torch.save({"weights": torch.ones(1)}, tmp_path / "other.pt")
    with pytest.raises(ParameterServerError, match="Not a parameter-server checkpoint"):
        variables.restore(tmp_path / "other.pt")
    with pytest.raises(ParameterServerError, match="lacks parameters of this model"):
        variables.load_state({"variables": {}, "optimizer_state": {}})
    variables.close()


@pytest.mark.timeout(30)
def test_push_errors_name_the_problem(servers):
    model, optimizer, _ = build("mlp", "sgd_momentum", torch.float32)
    variables = _variables(model, optimizer, servers, None)
    with pytest.raises(ParameterServerError, match="has no optimizer"):
        variables.push({n: torch.zeros_like(p) for n, p in model.named_parameters()})
    variables.create(dict(model.named_parameters()), optimizer)
    with pytest.raises(ParameterServerError, match="INVALID_ARGUMENT: Malformed parameter-server message: tensors do not match the destinations"):
        variables.push({n: torch.zeros(1) for n, _ in model.named_parameters()})
    servers[1].stop()
    with pytest.raises(ParameterServerError, match="ps:1 at .* failed Pull. Received: UNAVAILABLE"):
        variables.pull_into(dict(model.named_parameters()))
    variables.close()


def test_optimizer_class_must_be_a_torch_optimizer():
    assert resolve_optimizer_class("torch.optim", "Adam") is torch.optim.Adam
    with pytest.raises(ParameterServerError, match="Not a torch optimizer class. Received: os.system"):
        resolve_optimizer_class("os", "system")
    with pytest.raises(ParameterServerError, match="Cannot find the optimizer class"):
        resolve_optimizer_class("torch.optim", "NoSuchOptimizer")
