"""A second process claiming a task index that is taken is refused at the rendezvous, at once, with an
error naming the task, its address and the holder; the running job is unharmed. Every process here is a
real process on 127.0.0.1 (the chief serves the store, as in a job)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from helpers import free_port

# One task of a two-worker job: meets (timeout 60 s: the chief's start, importing torch, is slow on a loaded
# machine), then, in "job" mode, waits for the test's go-ahead in
# the store, all-reduces ones and prints the sum; any error is printed as its class and message.
_TASK = """
import json, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from stratagem.cluster import init_process_group, parse_tf_config
port, index, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cluster = parse_tf_config({"cluster": {"worker": [f"127.0.0.1:{port}", "127.0.0.1:1"]},
                           "task": {"type": "worker", "index": index}})
started = time.monotonic()
try:
    store = init_process_group(cluster, "gloo", timeout=60)
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc), "after": time.monotonic() - started}))
    sys.exit(3)
if mode == "job":
    store.wait(["test/go"], timedelta(seconds=60))
t = torch.ones(3)
dist.all_reduce(t)
print(json.dumps({"sum": t.tolist()}))
dist.barrier()
dist.destroy_process_group()
"""


def _start(port: int, index: int, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _TASK, str(port), str(index), mode], stdout=subprocess.PIPE, text=True
    )


def _job_store(port: int) -> dist.TCPStore:
    """A client of the chief's store, once the chief listens (a client that tries too early backs off for
    tens of seconds)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    return dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=60))


def _result(process: subprocess.Popen[str]) -> tuple[int, dict]:
    out, _ = process.communicate(timeout=180)
    return process.returncode, json.loads(out.strip().splitlines()[-1])


def _assert_refused(outcome: dict, port: int, task: str, address: str, *, within: float = 60.0) -> None:
    assert outcome["error"] == "ClusterError", outcome
    message = outcome["message"]
    assert message.startswith(
        f"Task {task} (rank {task[-1]}, address {address}) of the job meeting at 127.0.0.1:{port} is already held by "
        "another process ("
    ), message
    assert "Received: a second claim of" in message and "Stop the duplicate" in message, message
    assert outcome["after"] < within, outcome


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_second_worker_one_arriving_mid_job_is_refused_and_the_job_finishes():
    # Before: the duplicate hung past its timeout without a word, or died of a raw Gloo error.
    port = free_port()
    job = [_start(port, 0, "job"), _start(port, 1, "job")]
    try:
        store = _job_store(port)
        store.wait(["stratagem/checked/0", "stratagem/checked/1"], timedelta(seconds=60))  # the job has met
        holder = store.get("stratagem/claim/1").decode().split(" #")[0]
        code, outcome = _result(_start(port, 1, "duplicate"))
        assert code == 3
        _assert_refused(outcome, port, "worker:1", "127.0.0.1:1", within=30.0)  # well before the timeout
        assert f"already held by another process ({holder})" in outcome["message"]
        store.set("test/go", "1")
        assert [_result(p) for p in job] == [(0, {"sum": [2.0, 2.0, 2.0]})] * 2
    finally:
        for p in job:
            p.kill()
            p.wait()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_worker_ones_starting_together_one_is_refused_the_other_joins():
    # Before: the loser got "Connection reset by peer" from Gloo. The job waits for the test's go-ahead, so
    # the winner cannot finish it (and take the chief's store away) before the loser has made its claim.
    port = free_port()
    chief = _start(port, 0, "job")
    store = _job_store(port)  # the chief listens: the two worker:1 start at once and race for the claim
    ones = [_start(port, 1, "job"), _start(port, 1, "job")]
    try:
        deadline = time.monotonic() + 120
        while all(p.poll() is None for p in ones):
            assert time.monotonic() < deadline, "neither worker:1 was refused within 120 s"
            time.sleep(0.1)
        (loser,) = [p for p in ones if p.poll() is not None]
        code, refused = _result(loser)
        assert code == 3, refused
        _assert_refused(refused, port, "worker:1", "127.0.0.1:1")
        store.set("test/go", "1")
        (winner,) = [p for p in ones if p is not loser]
        assert _result(winner) == (0, {"sum": [2.0, 2.0, 2.0]})
        assert _result(chief) == (0, {"sum": [2.0, 2.0, 2.0]})
    finally:
        for p in [chief, *ones]:
            p.kill()
            p.wait()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_second_chief_is_refused_naming_the_holder_and_the_job_finishes():
    # The chief's task is held by the process that serves the store at its address: a second chief cannot
    # listen there, reads the holder's claim from that store, and is refused before it touches the job.
    # Before: "The chief (worker:0) cannot listen at ...", which named neither the task's holder nor its pid.
    port = free_port()
    job = [_start(port, 0, "job"), _start(port, 1, "job")]
    try:
        store = _job_store(port)
        store.wait(["stratagem/checked/0", "stratagem/checked/1"], timedelta(seconds=60))
        holder = store.get("stratagem/claim/0").decode().split(" #")[0]
        assert holder.endswith(f" pid {job[0].pid}"), holder
        code, outcome = _result(_start(port, 0, "duplicate"))
        assert code == 3
        _assert_refused(outcome, port, "worker:0", f"127.0.0.1:{port}", within=30.0)
        assert f"already held by another process ({holder})" in outcome["message"]
        store.set("test/go", "1")
        assert [_result(p) for p in job] == [(0, {"sum": [2.0, 2.0, 2.0]})] * 2
    finally:
        for p in job:
            p.kill()
            p.wait()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_chiefs_starting_together_one_is_refused_naming_the_other():
    # The loser of the race for the port reads the winner's claim (waiting for it if the winner has bound the
    # port but not yet claimed). Before: "The chief (worker:0) cannot listen at ...", naming no holder.
    port = free_port()
    chiefs = [_start(port, 0, "job"), _start(port, 0, "job")]
    worker = _start(port, 1, "job")
    try:
        deadline = time.monotonic() + 120
        while all(p.poll() is None for p in chiefs):
            assert time.monotonic() < deadline, "neither chief was refused within 120 s"
            time.sleep(0.1)
        (loser,) = [p for p in chiefs if p.poll() is not None]
        (winner,) = [p for p in chiefs if p is not loser]
        code, refused = _result(loser)
        assert code == 3, refused
        _assert_refused(refused, port, "worker:0", f"127.0.0.1:{port}")
        assert f" pid {winner.pid})" in refused["message"], refused
        _job_store(port).set("test/go", "1")
        assert [_result(p) for p in (winner, worker)] == [(0, {"sum": [2.0, 2.0, 2.0]})] * 2
    finally:
        for p in [*chiefs, worker]:
            p.kill()
            p.wait()
