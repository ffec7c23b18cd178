"""Every refusal of the parameter-server package says what is wrong; tasks never wait forever for a lost chief."""

from __future__ import annotations

import threading
import time
from collections import UserDict

import pytest
import torch
from cases import build

from stratagem.cluster import free_ports
from stratagem.errors import (
    CollectiveTimeoutError,
    InputError,
    ParameterServerError,
    ReplicaError,
    WireFormatError,
)
from stratagem.strategies.parameter_server import (
    ClusterCoordinator,
    InProcessCluster,
    ParameterServerStrategy,
    fit_steps,
    functions,
    wire,
)
from stratagem.strategies.parameter_server import (
    strategy as strategy_module,
)
from stratagem.strategies.parameter_server.optimizers import optimizer_spec
from stratagem.strategies.parameter_server.server import SERVICE as PS_SERVICE
from stratagem.strategies.parameter_server.server import ParameterServer
from stratagem.strategies.parameter_server.transport import Client, Security, Server
from stratagem.strategies.parameter_server.worker import SERVICE as WORKER_SERVICE
from stratagem.strategies.parameter_server.worker import WorkerService

SECURITY = Security(token="errors")


def _cluster(kind: str, index: int = 0) -> dict:
    ports = free_ports(3)
    return {
        "cluster": {
            "chief": [f"127.0.0.1:{ports[0]}"],
            "worker": [f"127.0.0.1:{ports[1]}"],
            "ps": [f"127.0.0.1:{ports[2]}"],
        },
        "task": {"type": kind, "index": index},
    }


def test_wire_refuses_dtypes_it_cannot_carry():
    with pytest.raises(WireFormatError, match="This dtype cannot travel. Received: w of dtype torch.uint16"):
        wire.encode("x", None, {"w": torch.zeros(2, dtype=torch.uint16)})


def test_server_reports_an_address_it_cannot_listen_on():
    with pytest.raises(
        ParameterServerError, match="Could not listen at 256.1.1.1:0: .* Received: address='256.1.1.1:0'"
    ):
        Server("stratagem.test", {}, security=SECURITY, address="256.1.1.1:0")


@pytest.mark.timeout(30)
def test_a_shared_file_let_go_before_its_serving_thread_starts_ends_that_thread_quietly():
    # The thread read areas.control, which closing the areas sets to None: an AttributeError in the thread.
    import mmap
    import os

    from stratagem.shm import parameter_server as shared

    buckets = [(torch.float32, 4)]
    areas = shared.Areas(mmap.mmap(-1, shared.file_size(buckets)), buckets)
    attached = shared.Attached(areas, "fingerprint", "worker:0", (os.getpid(), None), False)
    areas.close()  # what detaching the file does, before the thread ran
    attached.let_go = True
    ps = ParameterServer(security=SECURITY, task="ps:0")
    try:
        assert ps._serve_file(attached) is None
    finally:
        ps.stop()


@pytest.mark.timeout(30)
def test_a_second_parameter_server_cannot_take_the_port_of_a_running_one():
    # gRPC's default SO_REUSEPORT let a second server bind the port and take part of the calls.
    first = ParameterServer(security=SECURITY, task="ps:0")
    try:
        port = first.address.rsplit(":", 1)[1]
        with pytest.raises(
            ParameterServerError, match=f"Could not listen at 127.0.0.1:{port}: port {port} is taken .*Stop the process"
        ):
            ParameterServer(security=SECURITY, address=first.address, task="ps:0")
        client = Client(first.address, PS_SERVICE, security=SECURITY, task="ps:0")
        assert client.call("Ping", "ping", timeout=10)[1]["task"] == "ps:0"
        client.close()
    finally:
        first.stop()


@pytest.mark.timeout(30)
def test_a_call_that_outlives_its_timeout_names_the_task():
    server = Server(
        "stratagem.test", {"Slow": lambda op, meta, t: (time.sleep(1.0), ("ok", None, {}))[1]}, security=SECURITY
    )
    try:
        client = Client(server.address, "stratagem.test", security=SECURITY, task="ps:5")
        with pytest.raises(CollectiveTimeoutError, match="ps:5 at .* did not answer Slow within 0.2 s"):
            client.call("Slow", "x", timeout=0.2)
    finally:
        server.stop()


@pytest.mark.timeout(30)
def test_parameter_server_refuses_malformed_requests():
    ps = ParameterServer(security=SECURITY)
    client = Client(ps.address, PS_SERVICE, security=SECURITY, task="ps:0")
    try:
        with pytest.raises(ParameterServerError, match="INVALID_ARGUMENT: Create needs a group index for every shard"):
            client.call("Create", "create", {"groups": {}}, {"w": torch.ones(2)}, timeout=10)
        with pytest.raises(
            ParameterServerError,
            match=r"INVALID_ARGUMENT: ps:0 holds a different set of shards than "
            r"the caller expects. Received: layout 'abc'",
        ):
            client.call("Pull", "pull", {"layout": "abc"}, timeout=10)
        with pytest.raises(ParameterServerError, match=r"INVALID_ARGUMENT: ps:0 holds no shard named \['w'\]"):
            client.call("Load", "load", {}, {"w": torch.ones(2)}, timeout=10)
        assert client.call("Ping", "ping", timeout=10)[1]["shards"] == 0  # still serving
        spec = optimizer_spec(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
        layout = client.call(
            "Create",
            "create",
            {"groups": {"w": 0, "b": 0}, "optimizer": spec},
            {"w": torch.ones(2), "b": torch.ones(3)},
            timeout=10,
        )[1]["layout"]
        with pytest.raises(ParameterServerError, match=r"INVALID_ARGUMENT: A push carries a shard twice. Received: "):
            client.call("Push", "push", {"layout": layout}, {"@0": torch.ones(5), "w": torch.ones(2)}, timeout=10)
        with pytest.raises(
            ParameterServerError,
            match=r"INVALID_ARGUMENT: Malformed .* tensors do not match the "
            r"destinations. Received: @0 torch.float32 \[4\]",
        ):
            client.call("Push", "push", {"layout": layout}, {"@0": torch.ones(4)}, timeout=10)
        with pytest.raises(ParameterServerError, match="INVALID_ARGUMENT: ps:0 holds a different set of shards"):
            client.call("Push", "push", {"layout": "stale"}, {"@0": torch.ones(5)}, timeout=10)
        client.call("Push", "push", {"layout": layout}, {"@0": torch.ones(5)}, timeout=10)
        values = client.call("Pull", "pull", {"layout": layout}, timeout=10)[2]
        assert torch.equal(values["@0"], torch.full((5,), 0.9))  # 1 - 0.1 * 1, the one push that was valid
        ps_meta = client.call("Ping", "ping", timeout=10)[1]
        assert ps_meta["shards"] == 2 and ps_meta["version"] == 1  # refused pushes changed nothing
        client.call("Create", "create", {"groups": {}}, {}, timeout=10)
        assert client.call("Ping", "ping", timeout=10)[1]["shards"] == 0  # still serving
    finally:
        client.close()
        ps.stop()


def test_optimizer_hyper_parameters_must_be_plain_values():
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    optimizer.param_groups[0]["schedule"] = object()
    with pytest.raises(InputError, match=r"hyper-parameter cannot be sent.*param_groups\[0\]\['schedule'\]"):
        optimizer_spec(optimizer)


def test_function_references_are_checked_on_arrival():
    with pytest.raises(ParameterServerError, match="Malformed function reference"):
        functions.resolve_function({"code": "print(1)"})
    with pytest.raises(ParameterServerError, match="Module 'no_such_module' is not loaded on this worker"):
        functions.resolve_function({"module": "no_such_module", "qualname": "f"})
    with pytest.raises(ParameterServerError, match=f"No function {__name__}.nothing on this worker"):
        functions.resolve_function({"module": __name__, "qualname": "nothing"})
    with pytest.raises(ParameterServerError, match="cannot run a function defined inside another function"):
        functions.resolve_function({"process": "another", "local": 0})
    with pytest.raises(ParameterServerError, match="Unknown reference in a message"):
        functions.decode({"$x": 1}, {})


def test_values_round_trip_and_errors_come_back_typed():
    encoder = functions.Encoder()
    value = {"a": (1, float("nan"), [torch.ones(2), None]), "b": "s"}
    back = functions.decode(encoder.encode(value), encoder.tensors)
    assert back["b"] == "s" and back["a"][0] == 1 and back["a"][1] != back["a"][1]
    assert torch.equal(back["a"][2][0], torch.ones(2)) and isinstance(back["a"], tuple)
    # A mapping that is not a dict (Hugging Face's BatchEncoding is a UserDict) travels as its items.
    batch = functions.decode(encoder.encode(UserDict(input_ids=torch.arange(3))), encoder.tensors)
    assert type(batch) is dict and torch.equal(batch["input_ids"], torch.arange(3))
    error = functions.rebuild_error({"module": "builtins", "type": "KeyError", "message": "k"}, "f on worker:0")
    assert isinstance(error, KeyError)
    unknown = functions.rebuild_error(
        {"module": "user_mod", "type": "Oops", "message": "bad", "traceback": "tb"}, "step #3 on worker:1"
    )
    assert isinstance(unknown, ReplicaError)
    assert "step #3 on worker:1. Received: user_mod.Oops: bad" in str(unknown)


@pytest.mark.timeout(30)
def test_worker_refuses_to_run_before_its_script_is_ready():
    service = WorkerService("worker:3", security=SECURITY, ready=False, ready_timeout=0.2)
    client = Client(service.address, WORKER_SERVICE, security=SECURITY, task="worker:3")
    try:
        with pytest.raises(ParameterServerError, match="worker:3 never reached coordinator.schedule"):
            client.call("Run", "run", {"fn": {}, "args": [], "kwargs": {}, "datasets": {}}, timeout=10)
    finally:
        client.close()
        service.stop()


@pytest.mark.timeout(60)
def test_chief_side_misuse_is_refused():
    with InProcessCluster(num_workers=1, num_ps=1) as cluster:
        strategy = ParameterServerStrategy(cluster)
        with pytest.raises(InputError, match="save needs a distributed model"):
            strategy.save("x.pt")
        with pytest.raises(InputError, match="distribute needs a torch.nn.Module. Received: str"):
            strategy.distribute("model")
        model, optimizer, _ = build("mlp", "sgd_momentum", torch.float32)
        with pytest.raises(InputError, match="optimizer must be a torch.optim.Optimizer. Received: dict"):
            strategy.distribute(model, {"lr": 0.1})
        model, optimizer = strategy.distribute(model, optimizer)
        with pytest.raises(InputError, match="runs inside a scheduled function.*on the chief"):
            optimizer.step()
        coordinator = ClusterCoordinator(strategy)
        iterator = iter(coordinator.create_per_worker_dataset(_numbers))
        with pytest.raises(InputError, match="per-worker iterator is read on the workers"):
            next(iterator)
        assert coordinator.fetch(coordinator.schedule(_next_number, args=(iterator,))) == 0
        with pytest.raises(InputError, match="optimizer.step\\(\\) before the model ran on worker:0"):
            coordinator.schedule(lambda: optimizer.step())  # in-process workers take closures
            coordinator.join()
        blocker = threading.Event()
        coordinator.schedule(blocker.wait, args=(5.0,))
        with pytest.raises(CollectiveTimeoutError, match="join\\(\\) timed out after 0.1 s. Received: 1 functions"):
            coordinator.join(timeout=0.1)
        blocker.set()
        coordinator.join()
        strategy.shutdown()
        with pytest.raises(InputError, match="The coordinator is shut down"):
            coordinator.schedule(_next_number, args=(iterator,))


@pytest.mark.timeout(60)
def test_a_chief_step_before_distribute_is_refused():
    with InProcessCluster(num_workers=1, num_ps=1) as cluster:
        strategy = ParameterServerStrategy(cluster)
        coordinator = ClusterCoordinator(strategy)
        with pytest.raises(
            InputError,
            match=r"A step ran before strategy.distribute\(model, optimizer\). Received: no "
            r"model. Distribute the model first",
        ):
            fit_steps.fit_steps(
                coordinator, lambda x, y: x.sum(), [(torch.zeros(2, 3), torch.zeros(2))], lambda loss: None
            )
        strategy.shutdown()


def _numbers():
    return iter(range(100))


def _next_number(iterator):
    return next(iterator)


@pytest.mark.timeout(60)
def test_every_worker_lost_fails_the_coordinator():
    with InProcessCluster(num_workers=1, num_ps=1) as cluster:
        strategy = ParameterServerStrategy(cluster)
        strategy.distribute(*build("mlp", "sgd_momentum", torch.float32)[:2])
        coordinator = ClusterCoordinator(strategy, worker_recovery_timeout=0.5)
        cluster.kill_worker(0)
        value = coordinator.schedule(_numbers)
        with pytest.raises(
            ParameterServerError,
            match=r"Every worker was lost. Received: worker:0 \(unreachable\) did not answer again within "
            r"worker_recovery_timeout=0.5 s",
        ):
            coordinator.join()
        with pytest.raises(ParameterServerError, match="Every worker was lost"):
            value.fetch()
        strategy.shutdown()


def test_cluster_and_role_errors():
    with pytest.raises(InputError, match="num_ps must be at least 1. Received: num_ps=0"):
        InProcessCluster(num_workers=1, num_ps=0)
    config = _cluster("chief")
    config["cluster"]["evaluator"] = ["127.0.0.1:1"]
    config["task"] = {"type": "evaluator", "index": 0}
    with pytest.raises(InputError, match="no evaluator role. Received: task evaluator:0"):
        ParameterServerStrategy(config, cluster_token="t", env={})
    with pytest.raises(
        InputError,
        match=r"rpc_timeout must be a finite number of seconds in \(0, 86400\]\. Received: rpc_timeout=0\. Pass",
    ):
        ParameterServerStrategy(_cluster("chief"), cluster_token="t", rpc_timeout=0, env={})
    with pytest.raises(
        InputError,
        match=r"ps_exit_delay must be a finite number of seconds in \[0, 86400\]\. Received: ps_exit_delay=-1\. Pass",
    ):
        ParameterServerStrategy(_cluster("chief"), cluster_token="t", ps_exit_delay=-1, env={})
    with pytest.raises(
        InputError,
        match="shared_memory must be None, True or False. Received: 'yes'. Pass None to use "
        "shared memory with servers on this host",
    ):
        ParameterServerStrategy(_cluster("chief"), cluster_token="t", shared_memory="yes", env={})
    no_workers = _cluster("chief")
    del no_workers["cluster"]["worker"]
    with pytest.raises(InputError, match="needs at least one worker task"):
        ParameterServerStrategy(no_workers, cluster_token="t", env={})


@pytest.mark.timeout(60)
def test_worker_task_refuses_to_serve_before_distribute_and_stops_when_the_chief_is_gone(monkeypatch):
    monkeypatch.setattr(strategy_module, "CHIEF_CHECK_SECONDS", 0.1)
    strategy = ParameterServerStrategy(_cluster("worker"), cluster_token="t", chief_timeout=0.5, env={})
    coordinator = ClusterCoordinator(strategy)
    with pytest.raises(InputError, match="worker:0 reached coordinator.schedule before strategy.distribute"):
        coordinator.schedule(_numbers)
    strategy.distribute(torch.nn.Linear(2, 2))  # a worker task sends nothing to the parameter servers
    started = time.monotonic()
    with pytest.raises(
        CollectiveTimeoutError, match="worker:0 lost the chief: chief:0 at 127.0.0.1:.* has not answered"
    ):
        coordinator.join()
    assert time.monotonic() - started < 10


@pytest.mark.timeout(60)
def test_ps_task_serves_until_the_chief_ends_the_job(monkeypatch):
    monkeypatch.setattr(strategy_module, "CHIEF_CHECK_SECONDS", 0.1)
    config = _cluster("ps")
    outcome: list[BaseException] = []

    def ps_task() -> None:
        try:
            ParameterServerStrategy(config, cluster_token="t", ps_exit_delay=0, chief_timeout=30, env={})
        except BaseException as exc:  # noqa: BLE001 - the test reads what the task ended with
            outcome.append(exc)

    chief = Server(
        strategy_module.CHIEF_SERVICE,
        {"Ping": lambda op, meta, t: ("pong", None, {})},
        security=Security(token="t"),
        address=config["cluster"]["chief"][0],
    )
    thread = threading.Thread(target=ps_task)
    thread.start()
    client = Client(config["cluster"]["ps"][0], PS_SERVICE, security=Security(token="t"), task="ps:0")
    try:
        assert client.call("Ping", "ping", timeout=20, wait_for_ready=True)[1]["task"] == "ps:0"
        client.call("Shutdown", "shutdown", timeout=10)  # the reply arrives before the server stops
        thread.join(20)
        assert isinstance(outcome[0], SystemExit) and outcome[0].code == 0
    finally:
        client.close()
        chief.stop()


@pytest.mark.timeout(60)
def test_ps_task_without_a_chief_fails_naming_it(monkeypatch):
    monkeypatch.setattr(strategy_module, "CHIEF_CHECK_SECONDS", 0.1)
    with pytest.raises(CollectiveTimeoutError, match="ps:0 lost the chief: chief:0"):
        ParameterServerStrategy(_cluster("ps"), cluster_token="t", chief_timeout=0.3, env={})


@pytest.mark.timeout(30)
def test_a_new_client_of_a_task_restarted_on_its_port_reaches_it_at_once():
    # gRPC shared one connection per address between every channel of the process: a new client inherited the
    # dead server's failure and its back-off, and was refused ("Connection refused") by the restarted one.
    first = ParameterServer(security=SECURITY, task="ps:0")
    old = Client(first.address, PS_SERVICE, security=SECURITY, task="ps:0")
    old.call("Ping", "ping", timeout=10)
    first.stop()
    with pytest.raises(ParameterServerError):
        old.call("Ping", "ping", timeout=2)
    again = ParameterServer(security=SECURITY, address=first.address, task="ps:0")
    new = Client(first.address, PS_SERVICE, security=SECURITY, task="ps:0")
    try:
        assert new.call("Ping", "ping", timeout=10)[1]["task"] == "ps:0"
    finally:
        for client in (old, new):
            client.close()
        again.stop()
