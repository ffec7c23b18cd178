"""Parameter servers apply the user's optimizer to their shards; checkpoints keep variables and optimizer state."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from cases import TOL, build, make_batches, train_reference

from stratagem.errors import CorruptCheckpointError, InputError, ParameterServerError
from stratagem.strategies.parameter_server import wire
from stratagem.strategies.parameter_server.checkpoint import CHECKPOINT_FORMAT
from stratagem.strategies.parameter_server.optimizers import optimizer_spec, resolve_optimizer_class
from stratagem.strategies.parameter_server.partitioners import (
    FixedShardsPartitioner,
    place,
)
from stratagem.strategies.parameter_server.server import ParameterServer
from stratagem.strategies.parameter_server.transport import Security
from stratagem.strategies.parameter_server.variables import ShardedVariables

SECURITY = Security(token="service-test")


@pytest.fixture
def servers():
    started = [ParameterServer(security=SECURITY, task=f"ps:{i}") for i in range(2)]
    yield started
    for ps in started:
        ps.stop()


def _variables(model, optimizer, servers, partitioner, shared_memory=None):
    groups = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    shards = place([(n, p, groups[id(p)]) for n, p in model.named_parameters()], len(servers), partitioner)
    return ShardedVariables(
        shards, [ps.address for ps in servers], security=SECURITY, rpc_timeout=20, shared_memory=shared_memory
    )


# Values travel through shared memory between tasks of one host (the default), over gRPC otherwise.
PATHS = pytest.mark.parametrize("shared_memory", [None, False], ids=["shared-memory", "grpc"])


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
@PATHS
def test_one_worker_pushing_in_turn_equals_plain_training(servers, opt_name, shared_memory):
    model, optimizer, shape = build("mlp", opt_name, torch.float64)
    reference = copy.deepcopy(model)
    ref_opt = type(optimizer)(reference.parameters(), **optimizer.defaults)
    batches = make_batches(shape, torch.float64)
    train_reference(reference, ref_opt, batches)

    variables = _variables(model, optimizer, servers, FixedShardsPartitioner(3), shared_memory)
    assert {s.ps for s in variables.shards} == {0, 1}
    variables.create(dict(model.named_parameters()), optimizer)
    worker_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in worker_model.parameters():
            p.zero_()  # the worker's copy starts wrong: every value it uses must come from a pull
    _train(variables, worker_model, batches)
    _assert_close(worker_model, reference, torch.float64)
    way = "gRPC" if shared_memory is False else "shared memory"
    assert [how.split(":")[0] for how in variables.transfers.values()] == [way, way]
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
    with pytest.raises(InputError, match="Not a parameter-server checkpoint"):
        variables.restore(tmp_path / "other.pt")
    with pytest.raises(InputError, match="lacks parameters of this model"):
        variables.load_state({"variables": {}, "optimizer_state": {}})
    variables.close()


class _Foreign:
    """An object torch.load(weights_only=True) refuses."""


def test_restore_of_a_missing_damaged_or_unsafe_file_names_it_and_says_what_to_do(servers, tmp_path):
    model, optimizer, _ = build("mlp", "sgd_momentum", torch.float32)
    variables = _variables(model, optimizer, servers, None)
    with pytest.raises(InputError, match=r"No checkpoint at .*missing.pt.*Check the path"):
        variables.restore(tmp_path / "missing.pt")
    (tmp_path / "garbage.pt").write_bytes(b"\x80\x04 not a checkpoint")
    with pytest.raises(
        CorruptCheckpointError, match=r"garbage.pt' is not a readable checkpoint: it is not a zip archive"
    ):
        variables.restore(tmp_path / "garbage.pt")
    torch.save({"format": "stratagem-ps-checkpoint", "x": _Foreign()}, tmp_path / "foreign.pt")
    with pytest.raises(InputError, match=r"foreign.pt' holds objects other than tensors") as caught:
        variables.restore(tmp_path / "foreign.pt")
    assert "weights_only=False" not in str(caught.value)
    torch.save({"format": CHECKPOINT_FORMAT}, tmp_path / "empty.pt")
    with pytest.raises(InputError, match=r"empty.pt' lacks its variables or optimizer state"):
        variables.restore(tmp_path / "empty.pt")
    variables.close()


@pytest.mark.timeout(30)
def test_push_errors_name_the_problem(servers):
    model, optimizer, _ = build("mlp", "sgd_momentum", torch.float32)
    variables = _variables(model, optimizer, servers, None)
    with pytest.raises(ParameterServerError, match="has no optimizer"):
        variables.push({n: torch.zeros_like(p) for n, p in model.named_parameters()})
    variables.create(dict(model.named_parameters()), optimizer)
    with pytest.raises(
        ParameterServerError,
        match="INVALID_ARGUMENT: Malformed parameter-server message: tensors do not match the destinations",
    ):
        variables.push({n: torch.zeros(1) for n, _ in model.named_parameters()})
    servers[1].stop()
    with pytest.raises(ParameterServerError, match="ps:1 at .* failed (Pull|PullShared|Attach). Received: UNAVAILABLE"):
        variables.pull_into(dict(model.named_parameters()))
    variables.close()


def test_optimizer_class_must_be_a_torch_optimizer():
    assert resolve_optimizer_class("torch.optim", "Adam") is torch.optim.Adam
    with pytest.raises(ParameterServerError, match="Not a torch optimizer class. Received: os.system"):
        resolve_optimizer_class("os", "system")
    with pytest.raises(ParameterServerError, match="Cannot find the optimizer class"):
        resolve_optimizer_class("torch.optim", "NoSuchOptimizer")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("push_shared", "pull_shared"),
    [(False, False), (None, False), (False, None)],
    ids=["grpc-both", "shared-push-grpc-pull", "grpc-push-shared-pull"],
)
def test_a_pull_never_sees_half_of_a_push(servers, monkeypatch, push_shared, pull_shared):
    # Each push adds exactly 1 to every element (SGD, lr 1, gradient -1), and pushes and pulls both
    # span several 2 MiB pieces, so a pull taken while a push is applied would show two values.
    # Every piece is cut 2 ms late, as if the network were slow: a push's updates then land while a
    # pull is still being sent.
    join_piece = wire.join_piece

    def slow_join_piece(*args, **kwargs):
        time.sleep(0.002)
        return join_piece(*args, **kwargs)

    monkeypatch.setattr(wire, "join_piece", slow_join_piece)
    params = {f"w{i}": torch.zeros(3 << 17) for i in range(3)}  # 1.5 MiB each, one bucket of 4.5 MiB
    optimizer = torch.optim.SGD(list(params.values()), lr=1.0)
    shards = place([(n, p, 0) for n, p in params.items()], 1, None)

    def variables(shared_memory):
        return ShardedVariables(
            shards, [servers[0].address], security=SECURITY, rpc_timeout=20, shared_memory=shared_memory
        )

    pusher, puller = variables(push_shared), variables(pull_shared)
    pusher.create(params, optimizer)
    gradients = {n: torch.full_like(p, -1.0) for n, p in params.items()}
    # Pushes go on until the pulls have seen several values (a push through shared memory is much faster
    # than a slowed pull), then stop; each adds exactly 1.
    pushed, seen, done, enough = [0], set(), threading.Event(), threading.Event()

    def push_all():
        try:
            while not enough.is_set() and pushed[0] < 2000:
                pusher.push(gradients)
                pushed[0] += 1
        finally:
            done.set()

    thread = threading.Thread(target=push_all)
    thread.start()
    local = {n: torch.empty_like(p) for n, p in params.items()}
    try:
        while not done.is_set() or not seen:
            puller.pull_into(local)
            values = torch.cat(list(local.values())).unique()
            assert values.numel() == 1, f"a pull saw a push half applied: values {values.tolist()[:8]}"
            seen.add(int(values.item()))
            if len(seen) > 5:
                enough.set()
    finally:
        enough.set()
        thread.join(30)
    puller.pull_into(local)
    assert all(torch.equal(t, torch.full_like(t, pushed[0])) for t in local.values())
    assert len(seen) > 3, f"pulls and pushes did not overlap enough to test anything: saw {sorted(seen)}"
    pusher.close()
    puller.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("update", ["push", "load"])
def test_a_pull_under_way_keeps_the_values_it_started_with(update):
    # White-box and deterministic: the pull's first piece is cut, the values change, the rest follows.
    ps = ParameterServer(security=SECURITY, task="ps:0")
    try:
        before = torch.arange(3 << 18, dtype=torch.float32)  # 3 MiB: two pieces
        optimizer = torch.optim.SGD([torch.nn.Parameter(before.clone())], lr=1.0)
        _, meta, _ = ps._create(
            "create", {"groups": {"w": 0}, "optimizer": optimizer_spec(optimizer)}, {"w": before.clone()}
        )
        reply = ps._pull("pull", {"layout": meta["layout"]}, {})
        first = next(reply)
        if update == "push":
            ps._push(iter(wire.encode_chunks("push", {"layout": meta["layout"]}, {"@0": torch.ones_like(before)})))
        else:
            ps._load("load", {"scalars": {}}, {"w": torch.zeros_like(before)})
        _, _, got = wire.decode(wire.join_chunks([first, *reply]))
        assert torch.equal(got["@0"], before)
        assert len(ps._reads) == 0  # sent, so forgotten
        _, _, now = wire.decode(wire.join_chunks(ps._pull("pull", {"layout": meta["layout"]}, {})))
        assert torch.equal(now["@0"], before - 1 if update == "push" else torch.zeros_like(before))
    finally:
        ps.stop()
