"""A worker that stops answering (SIGSTOP) mid-step, with real processes on 127.0.0.1: the coordinator's heartbeat
finds it, its step runs elsewhere and join() finishes with every result; continued (SIGCONT) it is taken back;
when every worker hangs, join() raises naming them."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stratagem import environ
from stratagem.cluster import free_ports

SCRIPT = str(Path(__file__).parent / "workers" / "ps_hung.py")
pytestmark = pytest.mark.multiprocess
HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT = 0.5, 3.0


class Job:
    """A chief, one parameter server and ``workers`` workers running ps_hung.py, their output merged in order."""

    def __init__(self, tmp_path: Path, workers: int, **settings: str) -> None:
        ports = free_ports(2 + workers)
        addresses = {
            "chief": [f"127.0.0.1:{ports[0]}"],
            "worker": [f"127.0.0.1:{p}" for p in ports[2:]],
            "ps": [f"127.0.0.1:{ports[1]}"],
        }
        drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        base = {k: v for k, v in environ.current().items() if k not in drop}
        base.update(
            STRATAGEM_CLUSTER_TOKEN="hung-test",
            PYTHONUNBUFFERED="1",
            PS_TEST_HEARTBEAT=f"{HEARTBEAT_INTERVAL},{HEARTBEAT_TIMEOUT}",
            PS_TEST_OUT=str(tmp_path / "out.json"),
        )
        base.update(settings)
        self.out = tmp_path / "out.json"
        self.output: queue.Queue = queue.Queue()
        self.log: list[str] = []
        tasks = [("ps", 0), *(("worker", i) for i in range(workers)), ("chief", 0)]
        self.processes = {}
        for kind, index in tasks:
            env = dict(base, TF_CONFIG=json.dumps({"cluster": addresses, "task": {"type": kind, "index": index}}))
            self.processes[f"{kind}:{index}"] = self._start(env, f"{kind}:{index}")

    def _start(self, env: dict[str, str], task: str) -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

        def pump() -> None:
            for line in process.stdout:
                self.output.put((task, line.rstrip()))

        threading.Thread(target=pump, daemon=True).start()
        return process

    def wait_for(self, text: str, timeout: float) -> float:
        """Reads the output until a line contains ``text``; returns when it was read (time.monotonic())."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                task, line = self.output.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line with {text!r} within {timeout:g} s:\n" + self.tail()) from None
            self.log.append(f"[{task}] {line}")
            if text in self.log[-1]:
                return time.monotonic()

    def drain(self) -> None:
        while not self.output.empty():
            self.log.append("[{}] {}".format(*self.output.get()))

    def tail(self) -> str:
        self.drain()
        return "\n".join(self.log[-60:])

    def signal(self, task: str, sig: signal.Signals) -> float:
        self.processes[task].send_signal(sig)
        return time.monotonic()

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait(10)


def _detection_s(result: dict, task: str, stopped_at: float) -> float:
    """Seconds from the SIGSTOP to the coordinator's record of ``task`` as hung (one monotonic clock per host)."""
    hung = [f for f in result["faults"] if f["task"] == task and f["kind"] == "hung" and f["at"] >= stopped_at]
    assert hung, result["faults"]
    assert hung[0]["silent_s"] >= HEARTBEAT_TIMEOUT, hung[0]  # named only after heartbeat_timeout of silence
    return hung[0]["at"] - stopped_at


@pytest.mark.timeout(180)
def test_a_stopped_worker_is_named_hung_and_its_step_runs_elsewhere(tmp_path):
    job = Job(tmp_path, workers=2, PS_TEST_STEPS="40", PS_TEST_STEP_SLEEP="0.3", PS_TEST_RECOVERY="4")
    try:
        for _ in range(3):
            job.wait_for("[worker:1] step started on worker:1", 90)
        stopped_at = job.signal("worker:1", signal.SIGSTOP)  # mid-step: it sleeps 0.3 s after its push
        assert job.processes["chief:0"].wait(90) == 0, job.tail()
        result = json.loads(job.out.read_text())
        assert len(result["losses"]) == 40
        detection = _detection_s(result, "worker:1", stopped_at)
        print(
            f"worker:1 found hung {detection:.2f} s after SIGSTOP (heartbeat {HEARTBEAT_INTERVAL}/{HEARTBEAT_TIMEOUT})"
        )
        assert 0 < detection < HEARTBEAT_TIMEOUT + 10, detection
        log = job.tail()
        assert "worker:1 hung (no heartbeat answer for" in log and "goes back to the queue" in log, log
        assert "worker:1 did not come back within 4 s" in log, log
        assert "hung after 3 s without a heartbeat answer" in result["explain"], result["explain"]
    finally:
        job.close()


@pytest.mark.timeout(180)
def test_a_stopped_worker_that_is_continued_is_taken_back(tmp_path):
    job = Job(tmp_path, workers=2, PS_TEST_STEPS="80", PS_TEST_STEP_SLEEP="0.3", PS_TEST_RECOVERY="60")
    try:
        for _ in range(3):
            job.wait_for("[worker:1] step started on worker:1", 90)
        stopped_at = job.signal("worker:1", signal.SIGSTOP)
        job.wait_for("[chief:0] worker:1 hung (no heartbeat answer for", 30)
        job.signal("worker:1", signal.SIGCONT)
        job.wait_for("[chief:0] worker:1 is back and takes functions again", 30)
        # Taken back: it runs new steps (the one cut when it hung may also finish there, its result unused).
        job.wait_for("[worker:1] step started on worker:1", 30)
        job.wait_for("[worker:1] step started on worker:1", 30)
        assert job.processes["chief:0"].wait(90) == 0, job.tail()
        result = json.loads(job.out.read_text())
        assert len(result["losses"]) == 80
        _detection_s(result, "worker:1", stopped_at)
        assert job.processes["worker:1"].wait(30) == 0, job.tail()  # it ends with the job, as a healthy worker
    finally:
        job.close()


@pytest.mark.timeout(120)
def test_every_worker_hung_fails_join_naming_them_within_the_timeouts(tmp_path):
    job = Job(tmp_path, workers=1, PS_TEST_STEPS="40", PS_TEST_STEP_SLEEP="0.3", PS_TEST_RECOVERY="3")
    try:
        for _ in range(2):
            job.wait_for("[worker:0] step started on worker:0", 90)
        stopped_at = job.signal("worker:0", signal.SIGSTOP)
        assert job.processes["chief:0"].wait(60) == 3, job.tail()
        failed_after = time.monotonic() - stopped_at
        result = json.loads(job.out.read_text())
        assert "Every worker was lost. Received: worker:0 (hung) did not answer again" in result["error"], result
        # heartbeat_timeout (3 s) + worker_recovery_timeout (3 s) + the chief's shutdown calls to the stopped worker
        assert failed_after < HEARTBEAT_TIMEOUT + 3 + 15, failed_after
        _detection_s(result, "worker:0", stopped_at)
    finally:
        job.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("heartbeat_timeout", "closure_timeout", "freeze_after"),
    [
        # The call to the frozen worker runs out (3 s) before its heartbeat has been silent for its limit (4 s).
        pytest.param(4.0, 3.0, 0.2, id="closure_timeout-shorter-than-heartbeat_timeout"),
        # closure_timeout (4 s) is the longer one, but the worker froze 3.5 s into its step: at the closure
        # deadline its heartbeat has been silent for about a second, short of its 3 s limit.
        pytest.param(3.0, 4.0, 3.5, id="closure_timeout-longer-than-heartbeat_timeout"),
    ],
)
def test_a_worker_frozen_mid_step_is_lost_not_stuck_whatever_the_closure_timeout(
    tmp_path, heartbeat_timeout, closure_timeout, freeze_after
):
    """A worker that stopped answering its heartbeat is lost, even when its function's closure_timeout runs out first:
    its step runs on the other worker and join() ends with every result, never "ran longer than closure_timeout"."""
    steps = 12
    job = Job(
        tmp_path,
        workers=2,
        PS_TEST_STEPS=str(steps),
        PS_TEST_STEP_SLEEP="0.1",
        PS_TEST_RECOVERY="2",
        PS_TEST_HEARTBEAT=f"{HEARTBEAT_INTERVAL},{heartbeat_timeout}",
        PS_TEST_CLOSURE=str(closure_timeout),
        PS_TEST_FREEZE=f"worker:1,2,{freeze_after}",  # it stops itself (SIGSTOP) that far into its 2nd step
    )
    try:
        stopped_at = job.wait_for("[worker:1] worker:1 stops itself (SIGSTOP)", 120)
        assert job.processes["chief:0"].wait(90) == 0, job.tail()
        result = json.loads(job.out.read_text())
        assert len(result["losses"]) == steps, result  # every function ran, at least once
        assert [(f["task"], f["kind"]) for f in result["faults"]] == [("worker:1", "hung")], result["faults"]
        fault = result["faults"][0]
        assert fault["silent_s"] >= heartbeat_timeout and fault["at"] >= stopped_at, fault  # the heartbeat's verdict
        log = job.tail()
        assert "worker:1 hung (no heartbeat answer for" in log and "goes back to the queue" in log, log
        assert "ran longer than closure_timeout" not in log, log
    finally:
        job.close()  # SIGKILL ends the stopped worker too
