"""The trace of a parameter-server job (issue 42, item 5): `stratagem launch --workers 2 --ps 1 --trace DIR` on
127.0.0.1, and `sg.fit(..., trace=DIR)` on an in-process cluster. Each scheduled function is a span on the worker
that ran it, with its pull and push to each parameter server (bytes worked out by hand) on a transport track; each
server applies every push on its `updates` track; the chief's dispatch of each function is joined to it by a flow
arrow; the merged file passes the checks Perfetto relies on, and `stratagem trace summary` reports the functions."""

from __future__ import annotations

import collections
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from stratagem import environ
from stratagem.cli.checks import check_trace_flag, traced_strategy_names
from stratagem.cluster import free_ports
from stratagem.errors import InputError, ParameterServerError
from stratagem.strategies.parameter_server import FixedShardsPartitioner, InProcessCluster, ParameterServerStrategy
from stratagem.strategies.parameter_server.tasks import TaskPlan
from stratagem.strategies.parameter_server.tracing import TaskTrace, TraceSession
from stratagem.strategies.parameter_server.transport import Client, Security
from stratagem.strategies.parameter_server.worker import SERVICE as WORKER_SERVICE
from stratagem.strategies.parameter_server.worker import WorkerService
from stratagem.trace.clocks import measure
from stratagem.trace.functions import PARTS
from stratagem.trace.merge import chrome_trace, load
from stratagem.trace.summary import report, summarize
from stratagem.trace.validate import problems

SCRIPT = str(Path(__file__).parent / "workers" / "trace_ps.py")
STEPS = 12
# Linear(6, 32) and Linear(32, 2) in float32, every shard on the one parameter server: a pull carries every value,
# a push every gradient.
MODEL_BYTES = (6 * 32 + 32 + 32 * 2 + 2) * 4


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_launch_trace_has_each_function_on_its_worker_with_its_rpcs_and_the_servers_updates(tmp_path):
    directory = tmp_path / "trace"
    env = {**environ.current(), "TR_STEPS": str(STEPS), "TR_MARK": str(tmp_path / "worker-1-ran")}
    command = [sys.executable, "-m", "stratagem", "launch", "--workers", "2", "--ps", "1", "--trace", str(directory)]
    done = subprocess.run([*command, SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in directory.iterdir()) == [
        "ps-0.json",
        "trace.json.gz",
        "worker-0.json",
        "worker-1.json",
    ]
    job = load(directory)
    assert [(w.task, w.rank, w.role) for w in job.workers] == [("worker:0", 0, "worker"), ("worker:1", 1, "worker"),
                                                                ("ps:0", 2, "ps")]  # fmt: skip
    workers, server = job.workers[:2], job.workers[2]
    ran = {w.task: [s for s in w.spans if s.category == "function"] for w in workers}
    assert all(ran.values()), ran  # worker:0 waits in its first function until worker:1 has run one
    numbers = sorted(s.args["closure"] for spans in ran.values() for s in spans)
    assert numbers == list(range(STEPS))  # every function once, on one worker
    for w in workers:
        spans = collections.Counter((s.track, s.category, s.name) for s in w.spans)
        n = len(ran[w.task])
        # Each function: a forward, an optimizer step, a wait for its pull and one for its push on the worker's
        # track, and the pull and push themselves on the transport track of ps:0.
        for key in [("functions", "forward", "forward"), ("functions", "optimizer", "optimizer step"),
                    ("functions", "wait", "pull"), ("functions", "wait", "push"),
                    ("transport: ps:0", "rpc", "pull from ps:0"), ("transport: ps:0", "rpc", "push to ps:0")]:  # fmt: skip
            assert spans[key] == n, (w.task, key, spans)
        rpcs = [s.args for s in w.spans if s.category == "rpc"]
        assert {(a["op"], a["bytes"], a["ps"]) for a in rpcs} == {
            ("pull", MODEL_BYTES, "ps:0"),
            ("push", MODEL_BYTES, "ps:0"),
        }
        for function in ran[w.task]:  # the function's own spans lie inside it
            inside = [
                s for s in w.spans if s.track == "functions" and s.category != "function" and s.step == function.step
            ]
            assert len(inside) == 4 and all(function.start <= s.start <= s.end <= function.end for s in inside)
    assert [s.track for s in server.spans if s.category == "update"] == ["updates"] * STEPS  # every push applied
    chief = collections.Counter(
        (s.category, s.track) for s in workers[0].spans if s.category in ("dispatch", "schedule")
    )
    assert chief[("schedule", "main")] == STEPS
    assert chief[("dispatch", "dispatch worker:0")] + chief[("dispatch", "dispatch worker:1")] == STEPS
    for w in (workers[1], server):  # one host, one monotonic clock: the measured offset lies within its bound of 0
        assert 0 < w.error_ns < 5_000_000 and abs(w.offset_ns) <= w.error_ns, (w.task, w.offset_ns, w.error_ns)
    document = chrome_trace(job)
    assert problems(document) == []
    starts = [e for e in document["traceEvents"] if e["ph"] == "s"]
    ends = {e["id"]: e["pid"] for e in document["traceEvents"] if e["ph"] == "f"}
    assert len(starts) == STEPS and all(e["pid"] == 0 for e in starts)  # from the chief's dispatch
    assert collections.Counter(ends.values()) == {0: len(ran["worker:0"]), 1: len(ran["worker:1"])}  # to its worker
    summary = report(job)
    assert [(r.task, r.functions) for r in summary.workers] == [(w.task, len(ran[w.task])) for w in workers]
    for row in summary.workers:
        assert sum(getattr(row, f"{part}_ms") for part in PARTS) == pytest.approx(row.functions_ms, abs=0.01)
        assert row.functions_ms + row.idle_ms == pytest.approx(row.span_ms, abs=0.01)
        assert (row.pulled_bytes, row.pushed_bytes) == (MODEL_BYTES * row.functions, MODEL_BYTES * row.functions)
    assert [(s.task, s.updates) for s in summary.servers] == [("ps:0", STEPS)]
    text = subprocess.run([sys.executable, "-m", "stratagem", "trace", "summary", str(directory)], capture_output=True,
                          text=True, timeout=60, env=environ.current())  # fmt: skip
    assert text.returncode == 0, text.stderr
    assert f"parameter-server trace: {STEPS} functions on 2 workers, 1 parameter server" in text.stdout
    assert "ps:0: 12 pushes applied" in text.stdout
    assert not (directory / "breakdown.png").exists()  # no step table, no plot


def _batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 2, (8,), generator=g)) for _ in range(4)]


@pytest.mark.timeout(90)
def test_fit_trace_on_an_in_process_cluster_writes_every_tasks_file_and_merges_them(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    with InProcessCluster(num_workers=2, num_ps=2) as cluster:
        strategy = ParameterServerStrategy(cluster, partitioner=FixedShardsPartitioner(2))
        try:
            sg.fit(strategy, net, torch.optim.SGD(net.parameters(), lr=0.1), F.cross_entropy, _batches(), epochs=2,
                   trace=tmp_path)  # fmt: skip
        finally:
            strategy.shutdown()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["chief.json", "ps-0.json", "ps-1.json", "trace.json.gz", "worker-0.json", "worker-1.json"]
    job = load(tmp_path)
    assert [(w.task, w.role) for w in job.workers] == [("worker:0", "worker"), ("worker:1", "worker"), ("ps:0", "ps"),
                                                       ("ps:1", "ps"), ("chief:0", "chief")]  # fmt: skip
    functions = [s for w in job.workers for s in w.spans if s.category == "function"]
    assert len(functions) == 8  # 4 batches, 2 epochs
    # Every tensor cut in two shards, one on each server: each pull and push carries half of the model to each.
    half = (6 * 16 + 16 + 16 * 2 + 2) * 4 // 2
    rpcs = {(s.track, s.args["op"], s.args["bytes"]) for w in job.workers for s in w.spans if s.category == "rpc"}
    assert rpcs == {(f"transport: ps:{i}", op, half) for i in (0, 1) for op in ("pull", "push")}
    assert (
        sum(1 for w in job.workers[2:4] for s in w.spans if s.category == "update") == 2 * 8
    )  # each push, each server
    assert problems(json.loads(gzip.open(tmp_path / "trace.json.gz").read())) == []
    with pytest.raises(InputError, match=r"no step that every worker shares.*Received: the files of worker:0"):
        summarize(job)


def test_only_the_coordinator_traces_and_only_span_by_span(tmp_path):
    with InProcessCluster(num_workers=1, num_ps=1) as cluster:
        strategy = ParameterServerStrategy(cluster)
        try:
            with pytest.raises(InputError, match=r"span by span.*Received: trace\(mode='summary'\) on chief:0\. Call"):
                strategy.trace(tmp_path, mode="summary").__enter__()
            with strategy.trace(tmp_path), pytest.raises(InputError, match=r"A trace is recording already"):
                strategy.trace(tmp_path).__enter__()
        finally:
            strategy.shutdown()
    assert os.listdir(tmp_path) == ["chief.json"]  # nothing was dispatched or placed: no other task was started


def test_a_task_refuses_a_trace_request_it_does_not_know():
    with pytest.raises(ParameterServerError, match=r"Unknown trace request on worker:3\. Received: 'rewind'"):
        TaskTrace("worker:3").handle("rewind", None, {})


def test_measure_keeps_the_round_trip_of_least_delay():
    # This clock reads 0, 10, 100, 104 (ns); the other answers 1000 then 2000: the second trip (4 ns) is kept,
    # its midpoint 102 against 2000.
    ticks = iter([0, 10, 100, 104])
    answers = iter([1000, 2000])
    offset = measure(lambda: next(answers), clock=lambda: next(ticks), samples=2)
    assert (offset.offset_ns, offset.error_ns, offset.samples) == (102 - 2000, 2, 2)
    with pytest.raises(ValueError, match=r"at least one round trip\. Received: samples=0"):
        measure(lambda: 0, clock=lambda: 0, samples=0)


def test_a_task_that_cannot_be_traced_is_named_and_the_others_files_are_written(tmp_path, caplog):
    security = Security(token="secret")
    service = WorkerService("worker:0", security=security)
    nobody = f"127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    plan = TaskPlan(task="chief:0", is_coordinator=True, workers_in_process=True,
                    workers=(("worker:0", service.address), ("worker:1", nobody)), parameter_servers=(),
                    security=security)  # fmt: skip
    session = TraceSession(plan, ps_service="unused", rpc_timeout=5.0)
    session.begin(tmp_path)
    try:
        session.worker_ready(Client(service.address, WORKER_SERVICE, security=security, task="worker:0"))
        session.worker_ready(Client(nobody, WORKER_SERVICE, security=security, task="worker:1"))
        assert "worker:1 records no trace (its file will be missing)" in caplog.text
        service.stop()  # lost before the end: it cannot write its file
        written = session.end()
    finally:
        service.stop()
    assert "worker:0 did not write its trace file" in caplog.text
    assert written == [tmp_path / "chief.json"] and os.listdir(tmp_path) == ["chief.json"]


def test_stratagem_train_takes_trace_with_the_parameter_server_and_tensor_parallelism():
    assert {"parameter_server", "tensor_parallel"} <= set(traced_strategy_names())
    for strategy in ("parameter_server", "tensor_parallel"):
        check_trace_flag(strategy, "traces/")  # no longer refused
