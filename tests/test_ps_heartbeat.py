"""The coordinator's heartbeat in one process: its arguments, cutting a call in flight, a function that is slow on a
worker that still answers, and what explain() says. Hung worker processes (SIGSTOP): test_ps_hung.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from cases import build

from stratagem.errors import CollectiveTimeoutError, InputError
from stratagem.strategies.parameter_server import ClusterCoordinator, InProcessCluster, ParameterServerStrategy
from stratagem.strategies.parameter_server.heartbeat import Cancellation, Heartbeat
from stratagem.strategies.parameter_server.transport import Client, Security, Server, task_lost

SECURITY = Security(token="heartbeat-test")


@pytest.fixture
def strategy():
    with InProcessCluster(num_workers=1, num_ps=1) as cluster:
        strategy = ParameterServerStrategy(cluster)
        strategy.distribute(*build("mlp", "sgd_momentum", torch.float32)[:2])
        yield strategy
        strategy.shutdown()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"heartbeat_interval": float("nan")}, r"heartbeat_interval must be a finite number.*Received: "),
        ({"heartbeat_timeout": 0}, r"heartbeat_timeout must be a finite number.*Received: heartbeat_timeout=0"),
        ({"heartbeat_timeout": True}, r"heartbeat_timeout=True of type bool"),
        ({"closure_timeout": float("inf")}, r"closure_timeout must be a finite number"),
        (
            {"heartbeat_interval": 5, "heartbeat_timeout": 5},
            r"heartbeat_timeout must be longer than heartbeat_interval.*heartbeat_interval=5, heartbeat_timeout=5",
        ),
    ],
)
def test_heartbeat_arguments_are_checked(strategy, kwargs, match):
    with pytest.raises(InputError, match=match):
        ClusterCoordinator(strategy, **kwargs)


@pytest.mark.timeout(30)
def test_explain_states_the_coordinators_waits(strategy):
    line = str(strategy.explain())
    assert "hung after 10 s without a heartbeat answer" in line and "(the ClusterCoordinator's defaults" in line
    assert "closure_timeout=300 s" in line and "worker_recovery_timeout=60 s" in line
    coordinator = ClusterCoordinator(strategy, heartbeat_interval=1, heartbeat_timeout=4, closure_timeout=90)
    line = str(strategy.explain())
    assert "hung after 4 s" in line and "every 1 s" in line and "closure_timeout=90 s" in line
    assert "defaults" not in line
    assert coordinator.timeouts()["heartbeat_timeout"] == 4


@pytest.mark.timeout(30)
def test_a_cancellation_cuts_a_call_in_flight_and_the_next_ones_until_reset():
    release = threading.Event()
    server = Server(
        "stratagem.test",
        {"Wait": lambda op, meta, t: (release.wait(20), ("ok", None, {}))[1]},
        security=SECURITY,
    )
    client = Client(server.address, "stratagem.test", security=SECURITY, task="worker:7")
    cancellation = Cancellation()
    try:
        threading.Timer(0.3, cancellation.cancel).start()
        started = time.monotonic()
        with pytest.raises(Exception) as cut:
            client.call("Wait", "x", timeout=20, cancellation=cancellation)
        assert time.monotonic() - started < 5 and task_lost(cut.value) and "worker:7" in str(cut.value)
        with pytest.raises(Exception) as again:  # cancelled until reset: a new call is cut as it starts
            client.call("Wait", "x", timeout=20, cancellation=cancellation)
        assert task_lost(again.value)
        cancellation.reset()
        release.set()
        assert client.call("Wait", "x", timeout=20, cancellation=cancellation)[0] == "ok"
    finally:
        release.set()
        client.close()
        server.stop()


@pytest.mark.timeout(30)
def test_a_silent_server_is_found_hung_after_the_timeout_and_back_at_its_next_answer():
    answering = threading.Event()
    answering.set()

    def ping(op, meta, tensors):
        if not answering.is_set():
            time.sleep(1.0)  # no answer within the ping's deadline, as from a stopped process
        return "pong", None, {}

    server = Server("stratagem.test", {"Ping": ping}, security=SECURITY)
    beat = Heartbeat(
        Client(server.address, "stratagem.test", security=SECURITY, task="worker:3"), interval=0.2, timeout=1.0
    )
    beat.start()
    try:
        assert beat.wait_answer(0, 5) and not beat.hung
        answering.clear()
        silent_at = time.monotonic()
        while not beat.hung and time.monotonic() - silent_at < 10:
            time.sleep(0.02)
        found = time.monotonic() - silent_at
        assert beat.hung and 0.7 < found < 5, found
        assert beat.cancellation.cancelled
        answers = beat.answers()
        answering.set()
        assert beat.wait_answer(answers, 5) and not beat.hung and not beat.cancellation.cancelled
    finally:
        beat.stop()
        server.stop()


@pytest.mark.timeout(30)
def test_a_verdict_waits_for_an_answer_from_now_on_or_for_the_heartbeats_own_limit():
    answering = threading.Event()
    answering.set()

    def ping(op, meta, tensors):
        if not answering.is_set():
            time.sleep(1.5)  # no answer within the ping's deadline, as from a stopped process
        return "pong", None, {}

    server = Server("stratagem.test", {"Ping": ping}, security=SECURITY)
    beat = Heartbeat(
        Client(server.address, "stratagem.test", security=SECURITY, task="worker:4"), interval=0.2, timeout=1.0
    )
    beat.start()
    try:
        assert beat.wait_answer(0, 5)
        asked = time.monotonic()
        assert beat.verdict() is True  # it answers: at its next ping
        assert time.monotonic() - asked < 0.9
        answering.clear()
        time.sleep(0.4)  # silent, but not yet for heartbeat_timeout: its last answer says nothing about now
        assert not beat.hung
        asked = time.monotonic()
        assert beat.verdict() is False  # given once the silence reaches heartbeat_timeout
        assert beat.hung and beat.silent_for() >= 1.0 and time.monotonic() - asked < 1.0 + 2 * 0.2 + 0.5
        assert beat.verdict() is False  # hung already: at once
        answers = beat.answers()
        answering.set()
        assert beat.wait_answer(answers, 5) and not beat.hung
        beat.stop()
        asked = time.monotonic()
        assert beat.verdict() is False and time.monotonic() - asked < 0.5  # stopped: no answer will come
    finally:
        beat.stop()
        server.stop()


@pytest.mark.timeout(30)
def test_a_function_slower_than_closure_timeout_on_an_answering_worker_fails_naming_it(strategy):
    coordinator = ClusterCoordinator(strategy, closure_timeout=0.5, heartbeat_interval=0.2, heartbeat_timeout=5)
    value = coordinator.schedule(_sleep, args=(2.0,))
    with pytest.raises(CollectiveTimeoutError, match=r"_sleep #0 ran longer than closure_timeout=0.5 s on worker:0"):
        coordinator.join()
    with pytest.raises(CollectiveTimeoutError, match="still answers its heartbeat"):
        value.fetch()
    assert coordinator.faults == []  # a slow function is not a lost worker


def _sleep(seconds):
    time.sleep(seconds)
    return seconds
