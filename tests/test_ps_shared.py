"""A worker and a parameter server on one host pull and push through a shared-memory file.

What is checked: the values are those of gRPC's path (and of plain torch); a worker's parameters
live in the file, so a pull copies nothing on its side; the server maps only a file the worker
made on the same host, named as ours, of the right size and nonce, from an authenticated call; a
malformed offer gets a clean refusal and the server goes on serving; files never stay behind;
and every reason not to share memory is said (a warning where the user should act, an error with
``shared_memory=True``).
"""

from __future__ import annotations

import copy
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from helpers import stop_process

from stratagem.errors import CollectiveTimeoutError, InputError, ParameterServerError
from stratagem.shm import eligibility
from stratagem.shm import files as shm_files
from stratagem.shm import parameter_server as shared
from stratagem.strategies.parameter_server.partitioners import place
from stratagem.strategies.parameter_server.server import SERVICE, ParameterServer
from stratagem.strategies.parameter_server.transport import Client, Security
from stratagem.strategies.parameter_server.variables import ShardedVariables

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(shared.eligible() is not None, reason=f"{shared.eligible()}")]

SECURITY = Security(token="shared-test")
COUNTERS = pytest.mark.skipif(eligibility.ordered_stores() is not None, reason=f"{eligibility.ordered_stores()}")


@pytest.fixture
def server():
    ps = ParameterServer(security=SECURITY, task="ps:0")
    yield ps
    ps.stop()


def _ours() -> set[str]:
    return {name for name in os.listdir(shm_files.DIRECTORY) if name.startswith(shared.PREFIX)}


def _mixed_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Two dtypes and two parameter groups: four buckets on one server."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    model[2].double()
    optimizer = torch.optim.Adam(
        [
            {"params": model[0].parameters(), "lr": 0.05},
            {"params": model[2].parameters(), "lr": 0.02, "weight_decay": 0.1},
        ]
    )
    return model, optimizer


def _variables(model, optimizer, addresses, **kwargs):
    groups = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    shards = place([(n, p, groups[id(p)]) for n, p in model.named_parameters()], len(addresses), None)
    return ShardedVariables(shards, addresses, security=SECURITY, **{"rpc_timeout": 20, **kwargs})


def _step(model, x):
    return model[2](model[1](model[0](x)).double()).square().mean()


def _pulled(address, **kwargs):
    """The mixed model created on the server at ``address``, and a worker's copy pulled once (attached)."""
    model, optimizer = _mixed_model()
    variables = _variables(model, optimizer, [address], **kwargs)
    variables.create(dict(model.named_parameters()), optimizer)
    params = dict(copy.deepcopy(model).named_parameters())
    variables.pull_into(params)
    return model, variables, params


@pytest.mark.parametrize("counters", [True, False], ids=["asking-by-counters", "asking-by-grpc-calls"])
def test_buckets_of_two_dtypes_and_groups_train_as_torch_does_and_live_in_the_file(server, monkeypatch, counters):
    if not counters:  # as on a machine without ordered stores: each pull and push is a small gRPC call
        monkeypatch.setattr(eligibility, "ordered_stores", lambda *what: "not x86-64")
    elif eligibility.ordered_stores() is not None:
        pytest.skip(eligibility.ordered_stores())
    model, optimizer = _mixed_model()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(
        [
            {"params": reference[0].parameters(), "lr": 0.05},
            {"params": reference[2].parameters(), "lr": 0.02, "weight_decay": 0.1},
        ]
    )
    variables = _variables(model, optimizer, [server.address])
    variables.create(dict(model.named_parameters()), optimizer)
    worker = copy.deepcopy(model)
    params = dict(worker.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.zero_()  # every value the worker uses must come from a pull
    variables.arrange(params)
    link = variables._links[0]
    assert (link.server is not None) is counters
    start, end = link.areas.pull[0].data_ptr(), link.areas.pull[0].data_ptr() + link.areas.nbytes
    assert all(start <= p.data_ptr() < end for p in params.values())  # the server writes them in place
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(4, 5, generator=g)
        variables.pull_into(params)
        worker.zero_grad()
        _step(worker, x).backward()
        variables.push({n: p.grad for n, p in params.items()})
        ref_opt.zero_grad()
        _step(reference, x).backward()
        ref_opt.step()
    variables.pull_into(params)
    for (name, got), want in zip(worker.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert len(server._segments) == 1
    assert variables.transfers["ps:0"].startswith("shared memory: ps:0 runs on this host")
    variables.close()
    assert len(server._segments) == 0  # detached
    assert all(p.abs().sum() > 0 for p in params.values())  # the worker's copy outlives the link


def test_no_file_stays_behind(server):
    before = _ours()
    model, optimizer = _mixed_model()
    variables = _variables(model, optimizer, [server.address])
    variables.create(dict(model.named_parameters()), optimizer)
    variables.pull_into(dict(copy.deepcopy(model).named_parameters()))
    assert len(server._segments) == 1
    assert _ours() == before  # unlinked as soon as the server mapped it
    variables.close()


def test_a_server_that_creates_the_shards_anew_is_attached_again(server):
    model, optimizer = _mixed_model()
    variables = _variables(model, optimizer, [server.address])
    variables.create(dict(model.named_parameters()), optimizer)
    worker = dict(copy.deepcopy(model).named_parameters())
    variables.pull_into(worker)
    first = variables._links[0].segment
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    variables.create(dict(model.named_parameters()), optimizer)  # a restarted chief: same shards, new values
    assert len(server._segments) == 0
    variables.pull_into(worker)  # told "unattached": over gRPC this once, then a new file
    for name, p in model.named_parameters():
        assert torch.equal(worker[name], p.detach()), name
    variables.pull_into(worker)
    assert variables._links[0].segment != first and len(server._segments) == 1
    variables.close()


def test_a_push_that_leaves_out_part_of_a_bucket_goes_over_grpc_and_is_applied(server):
    model, variables, params = _pulled(server.address)
    grads = {n: torch.ones_like(p) for n, p in params.items()}
    grads["0.bias"] = None  # a bucket of group 0 without one of its parameters
    variables.push(grads)
    variables.pull_into(params)
    assert torch.equal(params["0.bias"], model[0].bias.detach())  # untouched, as torch leaves it
    assert not torch.equal(params["0.weight"], model[0].weight.detach())
    variables.close()


def _offer(server, **changes):
    """A real file made for the server's buckets and the Attach request for it, with ``changes`` to its fields."""
    model, optimizer = _mixed_model()
    variables = _variables(model, optimizer, [server.address], shared_memory=False)
    variables.create(dict(model.named_parameters()), optimizer)
    layout = variables._layout(0, variables._by_ps[0], dict(model.named_parameters()))
    path, nonce, mapping = shared.make_file(layout.sizes)
    meta = {**shared.offer(path, nonce, "worker:7", layout.fingerprint), **changes}
    variables.close()
    return path, mapping, meta


def _call(server, method, meta, token="shared-test"):
    client = Client(server.address, SERVICE, security=Security(token=token), task="ps:0")
    try:
        return client.call(method, method.lower(), meta, timeout=10, small_reply=True)
    finally:
        client.close()


@pytest.mark.parametrize(
    ("changes", "refusal"),
    [
        ({"host": "elsewhere/boot"}, "worker:7 runs on another host than ps:0"),
        ({"nonce": "ab" * 16}, "is not the file worker:7 made (another nonce)"),
        ({"layout": "0" * 24}, "worker:7 expects other shards than ps:0 holds"),
    ],
)
def test_the_server_maps_only_the_file_the_worker_made_on_this_host(server, changes, refusal):
    path, mapping, meta = _offer(server, **changes)
    try:
        op, reply, _ = _call(server, "Attach", meta)
    finally:
        os.unlink(path)
        mapping.close()
    assert op == "refused" and refusal in reply["why"]
    assert len(server._segments) == 0


@pytest.mark.parametrize(
    ("changes", "complaint"),
    [
        ({"name": "../../etc/passwd"}, "not one of stratagem's in /dev/shm"),
        ({"name": "stratagem-ps-x/../../y"}, "not one of stratagem's in /dev/shm"),
        (
            {"nonce": "zz"},
            "a nonce of 32 hex digits. Received: nonce='zz'. Offer a file made by "
            "stratagem.shm.parameter_server.make_file.",
        ),
        ({"pid": "1"}, "pid (an integer). Received: host="),
        (
            "not a dict",
            "Attach needs a JSON object. Received: str. Send {name, nonce, host, task, pid, start, layout}.",
        ),
    ],
)
def test_a_malformed_offer_is_refused_and_the_server_goes_on_serving(server, changes, complaint):
    path, mapping, meta = _offer(server)
    try:
        with pytest.raises(ParameterServerError, match=f"INVALID_ARGUMENT: .*{re.escape(complaint)}"):
            _call(server, "Attach", changes if isinstance(changes, str) else {**meta, **changes})
        op, _, _ = _call(server, "Attach", meta)  # the same server takes the good offer
        # Both hold the file now, so the server has removed its name (a worker killed now leaves nothing).
        assert not os.path.exists(path)
    finally:
        shm_files.unlink(path)
        mapping.close()
    assert op == "attached"


@pytest.mark.parametrize("token", ["wrong", None])
def test_an_offer_without_the_token_is_refused_before_it_is_read(server, token):
    path, mapping, meta = _offer(server)
    try:
        if token is None:
            channel = grpc.insecure_channel(server.address)
            with pytest.raises(grpc.RpcError) as caught:
                channel.unary_unary(f"/{SERVICE}/Attach_11")(b"anything", timeout=10)
            channel.close()
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        else:
            with pytest.raises(ParameterServerError, match="UNAUTHENTICATED: Wrong cluster token"):
                _call(server, "Attach", meta, token=token)
    finally:
        os.unlink(path)
        mapping.close()
    assert len(server._segments) == 0


@pytest.mark.parametrize("counters", [True, False], ids=["served-by-counters", "served-by-calls"])
def test_the_file_of_a_worker_process_that_exited_is_let_go(server, counters):
    if counters and eligibility.ordered_stores() is not None:
        pytest.skip(eligibility.ordered_stores())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path, mapping, meta = _offer(server, pid=child.pid, start=shm_files.process_start(child.pid), counters=counters)
        assert _call(server, "Attach", meta)[0] == "attached"
        assert not os.path.exists(path)  # the server removed its name once it had mapped it
        mapping.close()
        assert len(server._segments) == 1
    finally:
        child.kill()
        child.wait(10)
    if counters:  # the thread serving its counters notices within 50 ms
        deadline = time.monotonic() + 5
        while len(server._segments) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(server._segments) == 0
    else:
        time.sleep(0.2)
        assert len(server._segments) == 1  # nobody watches it: the next attach lets it go
    path, mapping, meta = _offer(server, counters=False)
    assert _call(server, "Attach", meta)[0] == "attached"  # each attach first lets go of those whose worker is gone
    assert not os.path.exists(path)
    mapping.close()
    assert len(server._segments) == 1


def test_shared_memory_true_makes_a_refusal_an_error_and_none_falls_back(server, monkeypatch, caplog):
    model, optimizer = _mixed_model()
    params = dict(copy.deepcopy(model).named_parameters())
    monkeypatch.setattr(shm_files, "host_identity", lambda: "another-host/boot")  # as if the server ran elsewhere
    strict = _variables(model, optimizer, [server.address], shared_memory=True)
    strict.create(dict(model.named_parameters()), optimizer)
    with pytest.raises(
        ParameterServerError,
        match="shared_memory=True, but chief cannot share memory with ps:0. "
        "Received: chief runs on another host than ps:0",
    ):
        strict.pull_into(params)
    strict.close()
    relaxed = _variables(model, optimizer, [server.address])
    with caplog.at_level(logging.INFO, logger="stratagem.strategies.parameter_server.variables"):
        relaxed.pull_into(params)
    assert relaxed.transfers == {"ps:0": "gRPC: chief runs on another host than ps:0"}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # another host: nothing to fix
    assert torch.equal(params["0.weight"], model[0].weight.detach())
    relaxed.close()


def test_one_host_without_room_in_dev_shm_warns_and_trains_over_grpc(server, monkeypatch, caplog):
    monkeypatch.setattr(shared, "make_file", lambda sizes, directory=None: "/dev/shm has no room for 1.0 MiB")
    model, optimizer = _mixed_model()
    variables = _variables(model, optimizer, [server.address])
    variables.create(dict(model.named_parameters()), optimizer)
    params = dict(copy.deepcopy(model).named_parameters())
    with caplog.at_level(logging.WARNING):
        variables.pull_into(params)
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "values to and from ps:0 go over gRPC, which is slower on one host, because /dev/shm has no room" in warning
    assert "Give the tasks one /dev/shm with room for the file (Docker: --ipc=host, --shm-size)" in warning
    assert torch.equal(params["0.weight"], model[0].weight.detach())
    variables.close()


def test_the_switch_sends_values_over_grpc_and_says_why_without_a_warning(server, monkeypatch, caplog):
    monkeypatch.setenv("STRATAGEM_SHARED_MEMORY", "0")
    model, optimizer = _mixed_model()
    variables = _variables(model, optimizer, [server.address])
    variables.create(dict(model.named_parameters()), optimizer)
    params = dict(copy.deepcopy(model).named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.zero_()
    with caplog.at_level(logging.INFO):
        variables.pull_into(params)
    assert variables.transfers == {"ps:0": "gRPC: turned off by STRATAGEM_SHARED_MEMORY=0"}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # asked for: nothing to fix
    assert len(server._segments) == 0
    for name, p in model.named_parameters():
        assert torch.equal(params[name], p.detach()), name
    variables.close()


def test_a_server_with_the_switch_off_refuses_the_file_it_is_offered(server, monkeypatch):
    path, mapping, meta = _offer(server)  # made while the switch is on (the worker's side)
    monkeypatch.setenv("STRATAGEM_SHARED_MEMORY", "0")  # and the server's side reads it off
    try:
        op, reply, _ = _call(server, "Attach", meta)
    finally:
        shm_files.unlink(path)
        mapping.close()
    assert (op, reply) == ("refused", {"why": "ps:0: turned off by STRATAGEM_SHARED_MEMORY=0", "same_host": False})
    assert len(server._segments) == 0


def test_shared_memory_must_be_none_true_or_false():
    with pytest.raises(InputError, match="shared_memory must be None, True or False. Received: 'yes'"):
        ShardedVariables([], ["127.0.0.1:1"], security=SECURITY, shared_memory="yes")


# ---- requests through the file's counters (Linux x86-64) ------------------------------------------
@COUNTERS
def test_a_failed_request_names_the_error_and_the_server_goes_on(server):
    model, variables, params = _pulled(server.address)
    link = variables._links[0]
    with pytest.raises(
        ParameterServerError,
        match=r"ps:0 failed a push through shared memory. Received: "
        r"WireFormatError: A shared push names buckets this server does not hold. Received: "
        r"buckets=\[99\], 2 buckets here. Name each bucket the push carries once\.",
    ):
        shared.request(link, shared.PUSH, [99], timeout=10, server="ps:0", what="push")
    variables.pull_into(params)  # the link was good; the server still serves it
    assert torch.equal(params["2.weight"], model[2].weight.detach())
    variables.close()


@COUNTERS
def test_a_stopped_server_lets_waiting_workers_go_to_grpc_which_names_it(server):
    _, variables, params = _pulled(server.address)
    server.stop()  # as if its process died, in this process: it lets go of every file
    with pytest.raises(ParameterServerError, match="ps:0 at .* failed (Pull|Attach). Received: UNAVAILABLE") as caught:
        variables.pull_into(params)
    assert caught.value.task == "ps:0"
    variables.close()


_SERVE = """
import sys, time
from stratagem.strategies.parameter_server.server import ParameterServer
from stratagem.strategies.parameter_server.transport import Security
ps = ParameterServer(security=Security(token="shared-test"), task="ps:0")
print(ps.address, flush=True)
time.sleep(120)
"""


@pytest.fixture
def server_process():
    child = subprocess.Popen([sys.executable, "-c", _SERVE], stdout=subprocess.PIPE, text=True)
    try:
        yield child, child.stdout.readline().strip()
    finally:
        child.kill()
        child.wait(10)


def _attached_to(address, rpc_timeout):
    _, variables, params = _pulled(address, rpc_timeout=rpc_timeout)
    assert variables._links[0].server is not None
    return variables, params


@COUNTERS
def test_a_server_process_that_dies_is_named_at_once_as_lost(server_process):
    child, address = server_process
    variables, params = _attached_to(address, rpc_timeout=30)
    child.kill()
    child.wait(10)
    started = time.monotonic()
    with pytest.raises(
        ParameterServerError,
        match=r"ps:0 \(pid \d+\) exited during a pull through shared memory. "
        r"Received: no answer, and no such process. Restart the job; it resumes",
    ) as caught:
        variables.pull_into(params)
    assert time.monotonic() - started < 3  # against a 30 s timeout
    assert caught.value.code.name == "UNAVAILABLE" and caught.value.task == "ps:0"  # the coordinator's "lost ps"
    assert 0 not in variables._links  # dropped: neither side knows where the other stands


@COUNTERS
def test_a_server_that_does_not_answer_times_out_naming_it(server_process):
    child, address = server_process
    model, optimizer = _mixed_model()
    variables = _variables(model, optimizer, [address], rpc_timeout=30)
    variables.create(dict(model.named_parameters()), optimizer)
    params = dict(copy.deepcopy(model).named_parameters())
    variables.arrange(params)  # the worker's parameters live in the file, where a pull writes
    variables.rpc_timeout = 1.0
    assert _shared_files_mapped(child.pid)
    stop_process(child.pid)  # every thread stopped before the pull, so none can answer it first
    try:
        started = time.monotonic()
        with pytest.raises(
            CollectiveTimeoutError,
            match="ps:0 did not answer a pull through shared memory within 1 s. "
            "Received: no answer. Check that ps:0 is alive and not overloaded, or raise rpc_timeout.",
        ):
            variables.pull_into(params)
        assert time.monotonic() - started < 5
        assert 0 not in variables._links
        with torch.no_grad():
            for p in params.values():
                p.fill_(7.0)  # the worker goes on with values of its own...
    finally:
        os.kill(child.pid, signal.SIGCONT)
    time.sleep(0.5)  # ...and the server, awake again, answers the old pull late, into the old file
    assert all(bool((p == 7.0).all()) for p in params.values())  # the parameters had moved out of it
    deadline = time.monotonic() + 10
    while _shared_files_mapped(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _shared_files_mapped(child.pid)  # told in the background, the server let go of the old file
    variables.close()


def _shared_files_mapped(pid: int) -> list[str]:
    return [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "stratagem-ps-" in line]


@COUNTERS
def test_an_unknown_request_is_refused_and_the_server_goes_on(server):
    model, variables, params = _pulled(server.address)
    with pytest.raises(ParameterServerError, match="Unknown request in a shared file. Received: operation 7"):
        shared.request(variables._links[0], 7, (), timeout=10, server="ps:0", what="request")
    variables.pull_into(params)
    assert torch.equal(params["0.weight"], model[0].weight.detach())
    variables.close()


@pytest.mark.parametrize("shared_memory", [None, False], ids=["shared-memory", "grpc"])
def test_a_pull_into_parameters_that_are_not_contiguous_copies_each_shard(server, shared_memory):
    model, optimizer = _mixed_model()
    variables = _variables(model, optimizer, [server.address], shared_memory=shared_memory)
    variables.create(dict(model.named_parameters()), optimizer)
    params = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    params["0.weight"] = torch.zeros(5, 7).t()  # a (7, 5) view that is not contiguous
    variables.pull_into(params)
    for name, p in model.named_parameters():
        assert torch.equal(params[name], p.detach()), name
    params["0.weight"] = torch.zeros(6, 7).t()  # not this model's shape
    with pytest.raises(
        ParameterServerError,
        match=r"The parameters do not match the shards on ps:0. Received: "
        r"shapes \[\[\(7, 6\)",
    ):
        variables.pull_into(params)
    variables.close()
