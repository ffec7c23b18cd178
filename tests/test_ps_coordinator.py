"""ParameterServerStrategy + ClusterCoordinator on an in-process cluster (servers on 127.0.0.1, threads)."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from cases import TOL, build, make_batches, train_reference

from stratagem.cluster import Cluster
from stratagem.errors import CollectiveTimeoutError, InputError, ParameterServerError
from stratagem.strategies.parameter_server import (
    ClusterCoordinator,
    FixedShardsPartitioner,
    InProcessCluster,
    ParameterServerStrategy,
)
from stratagem.strategies.parameter_server.functions import function_ref


@pytest.fixture
def cluster2():
    with InProcessCluster(num_workers=2, num_ps=2) as cluster:
        yield cluster


def _step_fn(model, optimizer):
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the worker replica's gradients
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


@pytest.mark.timeout(60)
@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam"])
def test_one_worker_equals_plain_training(opt_name):
    model, optimizer, shape = build("mlp", opt_name, torch.float64)
    reference = copy.deepcopy(model)
    ref_opt = type(optimizer)(reference.parameters(), **optimizer.defaults)
    batches = make_batches(shape, torch.float64)
    train_reference(reference, ref_opt, batches)
    with InProcessCluster(num_workers=1, num_ps=2) as cluster:
        strategy = ParameterServerStrategy(cluster, partitioner=FixedShardsPartitioner(2))
        before = strategy.explain()
        assert before.decision("variables").choice == "not placed yet"
        assert (
            before.decision("values between workers and parameter servers").choice
            == "shared memory on one host, else gRPC"
        )
        assert before.details["shards"] == "placed by distribute(model, optimizer)"
        ps_model, ps_optimizer = strategy.distribute(model, optimizer)
        coordinator = ClusterCoordinator(strategy)
        step = _step_fn(ps_model, ps_optimizer)
        losses = [coordinator.schedule(step, args=(x, y)) for x, y in batches]  # one worker: run in order
        coordinator.join()
        assert all(loss.done() for loss in losses)
        ps_model.pull()
        for (name, got), want in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(got, want, **TOL[torch.float64], msg=lambda m, n=name: f"{n}: {m}")
        explanation = strategy.explain()
        assert explanation.decision("variables").choice == "12 shards"  # 3 layers x (weight, bias), each cut in 2
        transfers = explanation.decision("values between workers and parameter servers")
        assert transfers.choice == "shared memory"
        for pair in ("worker:0 -> ps:0", "worker:0 -> ps:1", "chief:0 -> ps:1"):  # the chief pulled its copy
            assert f"{pair}: shared memory: ps:" in transfers.reason
        assert explanation.details["shards"]["0.weight/part_1"] == "ps:1 rows 8:16"
        strategy.shutdown()


def _dataset():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=g)
    while True:
        x = torch.randn(16, 6, generator=g)
        yield x, (x @ w).argmax(dim=1)


@pytest.mark.timeout(60)
def test_two_workers_train_asynchronously_with_per_worker_datasets(cluster2):
    torch.manual_seed(0)
    model, optimizer, _ = build("mlp", "adam", torch.float32)
    strategy = ParameterServerStrategy(cluster2)
    model, optimizer = strategy.distribute(model, optimizer)
    coordinator = ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(_dataset))
    seen_workers = set()

    def step(iterator):
        from stratagem.strategies.parameter_server.worker import current_worker

        seen_workers.add(current_worker().task)
        x, y = next(iterator)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return {"loss": loss, "n": len(x)}

    results = [coordinator.schedule(step, args=(iterator,)) for _ in range(60)]
    coordinator.join()
    assert coordinator.done()
    values = coordinator.fetch(results)
    assert all(v["n"] == 16 for v in values)
    first, last = sum(v["loss"] for v in values[:10]) / 10, sum(v["loss"] for v in values[-10:]) / 10
    assert last < 0.8 * first, (first, last)
    assert seen_workers == {"worker:0", "worker:1"}
    strategy.shutdown()


@pytest.mark.timeout(60)
def test_first_error_is_reraised_and_pending_work_cancelled(cluster2):
    model, optimizer, _ = build("mlp", "sgd_momentum", torch.float32)
    strategy = ParameterServerStrategy(cluster2)
    model, optimizer = strategy.distribute(model, optimizer)
    coordinator = ClusterCoordinator(strategy)
    gate, later = threading.Event(), threading.Event()

    def slow(i):
        gate.wait(10)
        return i

    def slower(i):
        later.wait(10)  # holds the other worker, so the queue still has work when the error lands
        return i

    def boom():
        raise ValueError("boom from a step")

    first = [coordinator.schedule(slow, args=(i,)) for i in range(2)]  # both workers busy
    failing = coordinator.schedule(boom)
    queued = [coordinator.schedule(slower, args=(i,)) for i in range(5)]
    gate.set()
    with pytest.raises(ValueError, match="boom from a step"):
        coordinator.join()
    later.set()
    assert [v.fetch() for v in first] == [0, 1]
    with pytest.raises(ValueError, match="boom from a step"):
        failing.fetch()
    cancelled = 0
    for value in queued:
        try:
            value.fetch()
        except ValueError:
            cancelled += 1
    assert cancelled >= 4  # at most one could have been taken by a worker before the error arrived
    # After join raised it, the coordinator works again.
    again = coordinator.schedule(slow, args=(7,))
    coordinator.join()
    assert again.fetch() == 7
    strategy.shutdown()


@pytest.mark.timeout(60)
def test_lost_parameter_server_is_named_promptly(cluster2):
    model, optimizer, _ = build("mlp", "sgd_momentum", torch.float32)
    strategy = ParameterServerStrategy(cluster2)
    model, optimizer = strategy.distribute(model, optimizer)
    coordinator = ClusterCoordinator(strategy)
    step = _step_fn(model, optimizer)
    x, y = make_batches((6,), torch.float32, sizes=[8])[0]
    coordinator.schedule(step, args=(x, y))
    coordinator.join()
    cluster2.kill_ps(1)
    started = time.monotonic()
    values = [coordinator.schedule(step, args=(x, y)) for _ in range(20)]
    with pytest.raises(ParameterServerError, match="Parameter server ps:1 was lost"):
        coordinator.join()
    assert time.monotonic() - started < 10
    with pytest.raises(ParameterServerError, match="ps:1"):
        values[-1].fetch()
    strategy.shutdown()


@pytest.mark.timeout(30)
def test_shutdown_ends_the_wait_for_a_lost_worker_at_once():
    # A coordinator shut down while it waits for an unreachable worker to come back must not leave its
    # thread waiting out worker_recovery_timeout (and reporting the worker lost a minute later).
    with InProcessCluster(num_workers=1, num_ps=1) as cluster:
        model, optimizer, _ = build("mlp", "sgd_momentum", torch.float32)
        strategy = ParameterServerStrategy(cluster)
        model, optimizer = strategy.distribute(model, optimizer)
        coordinator = ClusterCoordinator(strategy, worker_recovery_timeout=60)
        x, y = make_batches((6,), torch.float32, sizes=[8])[0]
        cluster.kill_worker(0)
        coordinator.schedule(_step_fn(model, optimizer), args=(x, y))
        threads = [t for t in threading.enumerate() if t.name.startswith("coordinator-")]
        time.sleep(0.5)  # the call fails at once; the thread is now waiting for worker:0
        assert threads and all(t.is_alive() for t in threads)
        started = time.monotonic()
        strategy.shutdown()
        for thread in threads:
            thread.join(5)
        assert not any(t.is_alive() for t in threads)
        assert time.monotonic() - started < 3


@pytest.mark.timeout(60)
def test_lost_worker_functions_run_elsewhere_and_it_comes_back(cluster2):
    torch.manual_seed(0)
    model, optimizer, _ = build("mlp", "adam", torch.float32)
    strategy = ParameterServerStrategy(cluster2)
    model, optimizer = strategy.distribute(model, optimizer)
    coordinator = ClusterCoordinator(strategy, worker_recovery_timeout=20)
    iterator = iter(coordinator.create_per_worker_dataset(_dataset))
    ran_on: list[tuple[str, float]] = []

    def step(iterator):
        from stratagem.strategies.parameter_server.worker import current_worker

        x, y = next(iterator)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        time.sleep(0.05)  # long enough that work is left when the lost worker comes back
        optimizer.step()
        optimizer.zero_grad()
        ran_on.append((current_worker().task, time.monotonic()))
        return loss

    values = [coordinator.schedule(step, args=(iterator,)) for _ in range(80)]
    while sum(v.done() for v in values) < 10:
        time.sleep(0.01)
    cluster2.kill_worker(0)  # its function in flight fails and goes back to the queue
    time.sleep(0.5)
    cluster2.restart_worker(0)
    restarted = time.monotonic()
    coordinator.join()
    losses = [v.fetch() for v in values]
    assert len(losses) == 80
    assert sum(losses[-10:]) < 0.8 * sum(losses[:10])
    # On a busy machine the other worker may finish the queue before worker 0 is back: keep giving work.
    deadline = time.monotonic() + 30
    while not any(task == "worker:0" and when > restarted for task, when in ran_on) and time.monotonic() < deadline:
        for _ in range(6):
            coordinator.schedule(step, args=(iterator,))
        coordinator.join()
    assert any(task == "worker:0" and when > restarted for task, when in ran_on), "the restarted worker got work"
    strategy.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", ["UNAVAILABLE", "CANCELLED"])
def test_a_call_cut_by_its_worker_stopping_runs_again_elsewhere(cluster2, monkeypatch, code):
    """A worker that stops while it runs a function ends the call CANCELLED (gRPC aborts a stopping server's
    calls) or UNAVAILABLE (its port is gone); either way the function runs again, it does not fail the job."""
    import grpc

    from stratagem.strategies.parameter_server import transport

    model, optimizer, _ = build("mlp", "sgd_momentum", torch.float32)
    strategy = ParameterServerStrategy(cluster2)
    strategy.distribute(model, optimizer)
    coordinator = ClusterCoordinator(strategy, worker_recovery_timeout=20)
    real_call = transport.Client.call
    cut: list[str] = []

    def call(self, method, op, *args, **kwargs):
        if method == "Run" and self.task == "worker:0" and not cut:
            cut.append(self.task)
            error = ParameterServerError(f"{self.task} failed Run. Received: {code}")
            error.code = getattr(grpc.StatusCode, code)  # type: ignore[attr-defined]
            error.task = self.task  # type: ignore[attr-defined]
            raise error
        return real_call(self, method, op, *args, **kwargs)

    monkeypatch.setattr(transport.Client, "call", call)
    values = [coordinator.schedule(_constant, args=(i,)) for i in range(6)]
    coordinator.join()
    assert cut == ["worker:0"]
    assert [v.fetch() for v in values] == list(range(6))
    strategy.shutdown()


def _constant(i):
    return i


def test_schedule_refuses_what_cannot_travel(cluster2):
    model, optimizer, _ = build("mlp", "sgd_momentum", torch.float32)
    strategy = ParameterServerStrategy(cluster2)
    strategy.distribute(model, optimizer)
    coordinator = ClusterCoordinator(strategy)
    with pytest.raises(InputError, match="cannot travel between tasks. Received: args\\[0\\] of type object"):
        coordinator.schedule(print, args=(object(),))
    with pytest.raises(InputError, match="Only functions can be scheduled"):
        coordinator.schedule(3)
    with pytest.raises(InputError, match="needs a module-level name"):
        function_ref(lambda: 1, local_ok=False)
    with pytest.raises(InputError, match="closure_timeout must be a finite number of seconds"):
        ClusterCoordinator(strategy, closure_timeout=0)
    with pytest.raises(CollectiveTimeoutError, match="has no result after 0.01 s"):
        coordinator.schedule(time.sleep, args=(1.0,)).fetch(timeout=0.01)
    coordinator.join()
    strategy.shutdown()


def test_strategy_refuses_incomplete_clusters():
    no_ps = Cluster.from_tf_config(
        {"cluster": {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, "task": {"type": "chief", "index": 0}}
    )
    with pytest.raises(InputError, match="needs at least one parameter-server task"):
        ParameterServerStrategy(no_ps, cluster_token="t", env={})
    with_ps = {
        "cluster": {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]},
        "task": {"type": "chief", "index": 0},
    }
    with pytest.raises(InputError, match="No cluster token"):
        ParameterServerStrategy(with_ps, env={})
    with pytest.raises(InputError, match="partitioner must be callable"):
        ParameterServerStrategy(with_ps, partitioner=3, cluster_token="t", env={})


def test_distribute_refuses_a_foreign_optimizer(cluster2):
    model, _, _ = build("mlp", "sgd_momentum", torch.float32)
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    strategy = ParameterServerStrategy(cluster2)
    with pytest.raises(InputError, match="must hold exactly the model's parameters"):
        strategy.distribute(model, other)
    strategy.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(InputError, match="already holds a model"):
        strategy.distribute(model)
    strategy.shutdown()


@pytest.mark.timeout(60)
def test_a_restarted_job_resumes_from_the_checkpoint(tmp_path):
    model, optimizer, shape = build("mlp", "adam", torch.float64)
    reference = copy.deepcopy(model)
    train_reference(reference, torch.optim.Adam(reference.parameters(), lr=0.01), make_batches(shape, torch.float64))
    batches = make_batches(shape, torch.float64)

    def job(model, optimizer, batches, restore):
        with InProcessCluster(num_workers=1, num_ps=2) as cluster:
            strategy = ParameterServerStrategy(cluster, partitioner=FixedShardsPartitioner(2))
            ps_model, ps_optimizer = strategy.distribute(model, optimizer)
            if restore:
                strategy.restore(str(tmp_path / "ckpt.pt"))
            coordinator = ClusterCoordinator(strategy)
            step = _step_fn(ps_model, ps_optimizer)
            for x, y in batches:
                coordinator.schedule(step, args=(x, y))
            coordinator.join()
            strategy.save(str(tmp_path / "ckpt.pt"))
            strategy.shutdown()
            return ps_model.pull()

    job(model, optimizer, batches[:2], restore=False)
    torch.manual_seed(123)  # the new job builds a differently initialised model: the checkpoint must win
    fresh, fresh_optimizer, _ = build("mlp", "adam", torch.float64)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    resumed = job(fresh, fresh_optimizer, batches[2:], restore=True)
    for (name, got), want in zip(resumed.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, **TOL[torch.float64], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.timeout(60)
def test_remote_values_can_be_arguments_of_later_functions(cluster2):
    strategy = ParameterServerStrategy(cluster2)
    strategy.distribute(*build("mlp", "sgd_momentum", torch.float32)[:2])
    coordinator = ClusterCoordinator(strategy)
    first = coordinator.schedule(torch.ones, args=(3,))
    second = coordinator.schedule(lambda pair: pair["a"][0] * 2 + pair["b"], args=({"a": [first], "b": 1.0},))
    coordinator.join()
    assert torch.equal(second.fetch(), torch.full((3,), 3.0))
    assert coordinator.fetch({"x": [first]})["x"][0].tolist() == [1.0, 1.0, 1.0]
    strategy.shutdown()


@pytest.mark.parametrize(("code", "lost"), [("UNAVAILABLE", True), ("CANCELLED", True), ("PERMISSION_DENIED", False)])
def test_a_parameter_server_that_stops_mid_call_is_named_lost(code, lost):
    import grpc

    from stratagem.strategies.parameter_server.worker import _lost_ps

    error = ParameterServerError(f"ps:1 failed Pull. Received: {code}")
    error.code, error.task = getattr(grpc.StatusCode, code), "ps:1"  # type: ignore[attr-defined]
    assert _lost_ps(error) == ("ps:1" if lost else None)
