"""The local launcher: environments per task, streamed prefixed output, failures, restarts, timeouts.

Task scripts are tiny Python files written to tmp_path; they import nothing heavy, so each
process starts in a few tens of milliseconds.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stratagem.cluster import (
    LaunchResult,
    OutputLine,
    describe_exit,
    free_ports,
    launch,
    launched_by_stratagem,
    relaunch,
    task_environments,
)
from stratagem.errors import ClusterError

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]

BASE_ENV = {"PATH": os.environ.get("PATH", ""), "RANK": "7", "TF_CONFIG": "{stale}"}


class Collector:
    """A sink that keeps every line and can wake a waiter when a given line arrives."""

    def __init__(self) -> None:
        self.lines: list[OutputLine] = []
        self.seen = threading.Event()
        self.trigger: tuple[str, str] | None = None

    def __call__(self, line: OutputLine) -> None:
        self.lines.append(line)
        if self.trigger == (line.task, line.text):
            self.seen.set()

    def texts(self, task: str, stream: str = "stdout") -> list[str]:
        return [line.text for line in self.lines if line.task == task and line.stream == stream]


def script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "task.py"
    path.write_text("import json, os, signal, sys, time\n" + body)
    return [sys.executable, str(path)]


def run(tmp_path: Path, body: str, **options) -> tuple[LaunchResult, Collector, float]:
    sink = Collector()
    options.setdefault("workers", 2)
    options.setdefault("timeout", 20)
    options.setdefault("grace_period", 2.0)
    start = time.monotonic()
    result = launch(script(tmp_path, body), env=BASE_ENV, sink=sink, **options)
    return result, sink, time.monotonic() - start


# -- environments --------------------------------------------------------------------------


def test_task_environments_by_hand():
    envs = task_environments(
        BASE_ENV, workers=2, ps=1, ports=[5000, 5001, 5002], token="abc", restart_count=2, devices_per_worker=4
    )
    assert sorted(envs) == ["ps:0", "worker:0", "worker:1"]
    cluster = {"worker": ["127.0.0.1:5000", "127.0.0.1:5001"], "ps": ["127.0.0.1:5002"]}
    worker1 = envs["worker:1"]
    assert json.loads(worker1["TF_CONFIG"]) == {"cluster": cluster, "task": {"type": "worker", "index": 1}}
    assert {
        k: worker1[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    } == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "5000",
    }
    assert (worker1["STRATAGEM_CLUSTER_TOKEN"], worker1["STRATAGEM_RESTART_COUNT"]) == ("abc", "2")
    assert worker1["STRATAGEM_DEVICES_PER_WORKER"] == "4" and worker1["PATH"] == BASE_ENV["PATH"]
    ps = envs["ps:0"]
    assert json.loads(ps["TF_CONFIG"])["task"] == {"type": "ps", "index": 0}
    # A parameter server has no rank; the parent's stale RANK must not leak into it.
    assert "RANK" not in ps and "MASTER_PORT" not in ps


def test_tasks_share_the_cores_unless_the_user_chose_a_thread_count(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    envs = task_environments(BASE_ENV, workers=3, ps=2, ports=[1, 2, 3, 4, 5], token="t")
    assert [envs[t]["OMP_NUM_THREADS"] for t in ("worker:0", "worker:2", "ps:0", "ps:1")] == ["2", "2", "1", "1"]
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert task_environments(BASE_ENV, workers=4, ports=[1, 2, 3, 4], token="t")["worker:3"]["OMP_NUM_THREADS"] == "1"
    chosen = task_environments({**BASE_ENV, "OMP_NUM_THREADS": "3"}, workers=2, ps=1, ports=[1, 2, 3], token="t")
    assert {env["OMP_NUM_THREADS"] for env in chosen.values()} == {"3"}


def test_task_environments_needs_one_port_per_task():
    with pytest.raises(ClusterError, match=r"Need one port per task\. Received: 2 ports for 2 workers and 1 ps tasks"):
        task_environments({}, workers=2, ps=1, ports=[1, 2], token="t")


def test_free_ports_are_distinct():
    ports = free_ports(5)
    assert len(set(ports)) == 5 and all(0 < p < 65536 for p in ports)


def test_launched_by_stratagem():
    assert launched_by_stratagem({"STRATAGEM_CLUSTER_TOKEN": "x"}) and not launched_by_stratagem({})


@pytest.mark.parametrize(
    ("returncode", "text"),
    [
        (0, "exited normally (exit code 0)"),
        (3, "exit code 3"),
        (-9, "killed by SIGKILL (killed, often the out-of-memory killer: check `dmesg` or the memory limit)"),
        (-11, "killed by SIGSEGV (segmentation fault, a crash in native code"),
        (137, "exit code 137 (128 + 9: a shell's report of killed by SIGKILL (killed, often the out-of-memory"),
        (-15, "killed by SIGTERM (terminated by another process"),
        (-99, "killed by unknown signal 99"),
    ],
)
def test_describe_exit(returncode, text):
    assert describe_exit(returncode).startswith(text)


# -- running -------------------------------------------------------------------------------

REPORT = """
task = json.loads(os.environ["TF_CONFIG"])["task"]
name = f"{task['type']}:{task['index']}"
print("task", name, "rank", os.environ.get("RANK"), "of", os.environ.get("WORLD_SIZE"),
      "local", os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE"),
      "master", os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
print("cluster", json.dumps(json.loads(os.environ["TF_CONFIG"])["cluster"]))
print("token", os.environ["STRATAGEM_CLUSTER_TOKEN"], "restart", os.environ["STRATAGEM_RESTART_COUNT"],
      "devices", os.environ.get("STRATAGEM_DEVICES_PER_WORKER"))
print("to stderr", name, file=sys.stderr)
ready = os.path.join(os.path.dirname(__file__), "ps_ready")
if task["type"] == "ps":
    open(ready, "w").close()
    time.sleep(60)  # a parameter server serves until the launcher stops it
deadline = time.time() + 10  # workers use the parameter server: wait until it is up
while "ps" in json.loads(os.environ["TF_CONFIG"])["cluster"] and not os.path.exists(ready) and time.time() < deadline:
    time.sleep(0.02)
"""


def test_each_task_gets_its_environment_and_prefixed_output(tmp_path):
    result, sink, elapsed = run(tmp_path, REPORT, workers=2, ps=1, devices_per_worker=2)
    assert result == LaunchResult(exit_code=0, failed_task=None, reason=None, restarts=0)
    assert elapsed < 10  # the parameter server was stopped, not waited for
    cluster = json.loads(sink.texts("worker:0")[1].removeprefix("cluster "))
    master_port = cluster["worker"][0].rpartition(":")[2]
    assert len(cluster["worker"]) == 2 and len(cluster["ps"]) == 1
    assert len(set(cluster["worker"] + cluster["ps"])) == 3
    for rank in (0, 1):
        lines = sink.texts(f"worker:{rank}")
        assert lines[0] == f"task worker:{rank} rank {rank} of 2 local {rank} 2 master 127.0.0.1 {master_port}"
        assert json.loads(lines[1].removeprefix("cluster ")) == cluster
        assert sink.texts(f"worker:{rank}", "stderr") == [f"to stderr worker:{rank}"]
    assert sink.texts("ps:0")[0] == "task ps:0 rank None of None local None None master None None"
    tokens = {sink.texts(task)[2] for task in ("worker:0", "worker:1", "ps:0")}
    assert len(tokens) == 1
    assert re.fullmatch(r"token [0-9a-f]{32} restart 0 devices 2", tokens.pop())


def test_output_is_streamed_while_the_task_runs(tmp_path):
    # worker:0 prints a line, then waits until the sink has received it: buffered output would hang.
    flag = tmp_path / "seen"
    body = f"""
print("first")
deadline = time.time() + 10
while not os.path.exists({str(flag)!r}) and time.time() < deadline:
    time.sleep(0.02)
print("second" if os.path.exists({str(flag)!r}) else "never saw the flag")
"""
    sink = Collector()
    sink.trigger = ("worker:0", "first")
    watcher = threading.Thread(target=lambda: sink.seen.wait(10) and flag.touch())
    watcher.start()
    result = launch(script(tmp_path, body), workers=1, env=BASE_ENV, sink=sink, timeout=20)
    watcher.join()
    assert result.ok and sink.texts("worker:0") == ["first", "second"]


STOPPABLE = """
rank = int(os.environ["RANK"])
with open(os.path.join(os.path.dirname(__file__), f"pid{{rank}}"), "w") as f:
    f.write(str(os.getpid()))
if rank == 1:
    here, world = os.path.dirname(__file__), int(os.environ["WORLD_SIZE"])
    deadline = time.time() + 10  # wait until every task has recorded its pid
    while time.time() < deadline and not all(os.path.exists(os.path.join(here, f"pid{{r}}")) for r in range(world)):
        time.sleep(0.02)
    {action}
signal.signal(signal.SIGTERM, signal.SIG_IGN) if rank == 2 else None  # only SIGKILL stops it
time.sleep(60)
"""


def _assert_stopped(tmp_path: Path, ranks) -> None:
    for rank in ranks:
        pid = int((tmp_path / f"pid{rank}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_failing_worker_is_reported_and_the_others_stopped(tmp_path):
    result, _, elapsed = run(tmp_path, STOPPABLE.format(action="sys.exit(3)"), workers=3, grace_period=0.5)
    assert (result.exit_code, result.failed_task, result.reason, result.restarts) == (3, "worker:1", "exit code 3", 0)
    assert elapsed < 10
    _assert_stopped(tmp_path, [0, 2])
    assert result.explain() == "attempt 0: worker:1 exit code 3\nfailed: worker:1 exit code 3; exit code 3"


def test_killed_worker_is_reported_as_likely_out_of_memory(tmp_path):
    result, _, _ = run(
        tmp_path, STOPPABLE.format(action="os.kill(os.getpid(), signal.SIGKILL)"), workers=3, grace_period=0.5
    )
    assert (result.exit_code, result.failed_task) == (137, "worker:1")
    assert "killed by SIGKILL (killed, often the out-of-memory killer" in result.reason
    _assert_stopped(tmp_path, [0, 2])


def test_segfault_is_named(tmp_path):
    result, sink, _ = run(tmp_path, STOPPABLE.format(action="os.kill(os.getpid(), signal.SIGSEGV)"), workers=2)
    assert (result.exit_code, result.failed_task) == (139, "worker:1")
    assert result.reason.startswith("killed by SIGSEGV (segmentation fault")
    # PYTHONFAULTHANDLER turns the crash into a traceback on the task's stderr.
    assert any("Segmentation fault" in text for text in sink.texts("worker:1", "stderr"))


def test_restart_after_a_first_failure(tmp_path):
    body = """
attempt = int(os.environ["STRATAGEM_RESTART_COUNT"])
print("attempt", attempt)
if attempt == 0 and os.environ["RANK"] == "1":
    sys.exit(5)
time.sleep(0.2 if attempt else 30)
"""
    result, sink, _ = run(tmp_path, body, workers=2, max_restarts=1)
    assert (result.exit_code, result.failed_task, result.restarts) == (0, None, 1)
    assert [(f.attempt, f.task, f.returncode) for f in result.failures] == [(0, "worker:1", 5)]
    assert sink.texts("worker:1") == ["attempt 0", "attempt 1"]
    assert result.explain().endswith("all workers exited normally after 1 restart(s)")


def test_restarts_run_out(tmp_path):
    result, _, _ = run(tmp_path, "sys.exit(2)", workers=1, max_restarts=2)
    assert (result.exit_code, result.failed_task, result.restarts) == (2, "worker:0", 2)
    assert [f.attempt for f in result.failures] == [0, 1, 2]
    assert result.as_dict()["failures"][2] == {
        "attempt": 2,
        "task": "worker:0",
        "returncode": 2,
        "reason": "exit code 2",
    }


def test_timeout_stops_everything(tmp_path):
    result, _, elapsed = run(tmp_path, "time.sleep(60)", workers=2, timeout=1.0, max_restarts=3)
    assert (result.exit_code, result.failed_task, result.restarts) == (124, None, 0)
    assert result.reason == "timed out after 1 s; still running: worker:0, worker:1"
    assert elapsed < 8


def test_parameter_server_that_exits_early_is_a_failure(tmp_path):
    body = """
task = json.loads(os.environ["TF_CONFIG"])["task"]
time.sleep(60 if task["type"] == "worker" else 0)
"""
    result, _, _ = run(tmp_path, body, workers=1, ps=1)
    assert (result.exit_code, result.failed_task) == (1, "ps:0")
    assert result.reason == "exited normally (exit code 0), but a parameter server must serve until the workers finish"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"argv": []}, r"The command to launch is empty\. Received: argv=\[\]"),
        ({"workers": 0}, r"At least one worker is needed\. Received: workers=0\. Pass workers >= 1"),
        ({"ps": -1}, r"parameter servers cannot be negative\. Received: ps=-1"),
        ({"devices_per_worker": 0}, r"Each worker needs at least one device\. Received: devices_per_worker=0"),
        ({"max_restarts": -1}, r"max_restarts cannot be negative\. Received: max_restarts=-1"),
        ({"timeout": 0}, r"timeout must be a finite number of seconds in \(0, 86400\]\. Received: timeout=0"),
        (
            {"grace_period": -1},
            r"grace_period must be a finite number of seconds in \[0, 86400\]\. Received: grace_period=-1",
        ),
    ],
)
def test_invalid_launch_options(options, message):
    kwargs = {"argv": [sys.executable, "-c", "pass"], "workers": 1, "env": BASE_ENV, "sink": print, **options}
    with pytest.raises(ClusterError, match=message):
        launch(**kwargs)


def test_relaunch_refuses_to_nest():
    env = {"STRATAGEM_CLUSTER_TOKEN": "t", "TF_CONFIG": '{"task": {"type": "worker", "index": 1}}'}
    with pytest.raises(
        ClusterError,
        match=r"Already running inside a task of `stratagem launch`, so relaunching "
        r"would start 2 more processes per task\. Received: STRATAGEM_CLUSTER_TOKEN set",
    ):
        relaunch(["train"], workers=2, env=env, sink=print)


def test_launched_workers_resolve_their_cluster_and_all_reduce(tmp_path):
    # The path MultiWorkerMirroredStrategy takes: launcher env -> resolve_cluster -> rendezvous -> gloo.
    body = """
import torch, torch.distributed as dist
from stratagem import environ
from stratagem.cluster import init_process_group, resolve_cluster
env = environ.current()
cluster = resolve_cluster(env=env)
init_process_group(cluster, "gloo", timeout=20, token=env["STRATAGEM_CLUSTER_TOKEN"])
tensor = torch.tensor([cluster.rank + 1.0])
dist.all_reduce(tensor)
print(cluster.source, cluster.task_name, cluster.rank, cluster.is_chief, tensor.item())
dist.destroy_process_group()
"""
    result, sink, _ = run(tmp_path, body, workers=2, timeout=40)
    assert result.ok, [line.text for line in sink.lines]
    # 1 + 2 = 3 on both ranks.
    assert sink.texts("worker:0") == ["TF_CONFIG worker:0 0 True 3.0"]
    assert sink.texts("worker:1") == ["TF_CONFIG worker:1 1 False 3.0"]


def test_a_failing_sink_does_not_hang_the_task(tmp_path, caplog):
    def broken_sink(line: OutputLine) -> None:
        raise ValueError("terminal gone")

    # 200 KB of output would fill a pipe that nobody drains, blocking the task forever.
    body = 'for i in range(2000):\n    print("x" * 100)\n'
    result = launch(script(tmp_path, body), workers=1, env=BASE_ENV, sink=broken_sink, timeout=20)
    assert result.ok
    assert "the output sink failed on a line of worker:0 stdout; dropping its further output" in caplog.text


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to see which processes live")
def test_tasks_end_when_their_launcher_is_killed_with_sigkill(tmp_path):
    # Each task (and a child it started, in its session) writes its pid and waits; the launcher is then
    # SIGKILLed, so it stops nobody. They used to run on, unsupervised.
    task = script(
        tmp_path,
        (
            "import subprocess\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"path = {str(tmp_path)!r} + '/' + json.loads(os.environ['TF_CONFIG'])['task']['type'] + "
            "str(json.loads(os.environ['TF_CONFIG'])['task']['index'])\n"
            "open(path + '.tmp', 'w').write(f'{os.getpid()} {child.pid}'); os.rename(path + '.tmp', path)\n"
            "time.sleep(60)\n"
        ),
    )
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys; from stratagem.cluster import launch\n"
                f"launch({task!r}, workers=2, ps=1, env={{'PATH': {os.environ.get('PATH', '')!r}}}, sink=lambda line: None, "
                "grace_period=1.0)\n"
            ),
        ]
    )
    try:
        files = [tmp_path / name for name in ("worker0", "worker1", "ps0")]
        deadline = time.monotonic() + 40
        while not all(f.exists() for f in files) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int(pid) for f in files for pid in f.read_text().split()]
        assert all(_alive(pid) for pid in pids)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in pids if _alive(pid)] == []
    finally:
        launcher.kill()
        for f in tmp_path.glob("*[0-9]"):
            for pid in f.read_text().split():
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass


PS_JOB = """
task = json.loads(os.environ["TF_CONFIG"])["task"]
name = f"{task['type']}{task['index']}"
here = os.path.dirname(os.path.abspath(__file__))
open(os.path.join(here, f"{name}.{os.getpid()}"), "w").close()
def wait_for(path):
    while not os.path.exists(os.path.join(here, path)):
        time.sleep(0.02)
if name == "worker1" and not os.path.exists(os.path.join(here, "died")):
    open(os.path.join(here, "died"), "w").close()
    {death}
if name == "ps0":
    time.sleep(60)  # serves until the launcher stops it
elif name == "worker0":
    wait_for("{chief_waits_for}")
    open(os.path.join(here, "done"), "w").close()
else:
    wait_for("done")
"""


def _starts(tmp_path: Path, name: str) -> int:
    return len(list(tmp_path.glob(f"{name}.*")))


@pytest.mark.parametrize("death", ["sys.exit(3)", "os.kill(os.getpid(), signal.SIGKILL)"])
def test_a_dead_worker_of_a_parameter_server_job_is_restarted_alone(tmp_path, death):
    # worker:1 dies once; the chief and ps:0 run on (one start each) while it is started again alone.
    # The launcher used to stop the whole job 1.4-2.8 s after a worker died.
    body = PS_JOB.replace("{death}", death).replace("{chief_waits_for}", "restarted-worker1")
    body = body.replace(
        'else:\n    wait_for("done")',
        'else:\n    if name == "worker1": open(os.path.join(here, "restarted-worker1"), "w").close()\n'
        '    wait_for("done")',
    )
    result, sink, _ = run(tmp_path, body, workers=2, ps=1, max_restarts=1, grace_period=0.5)
    assert (result.exit_code, result.failed_task, result.restarts, result.failures) == (0, None, 0, ())
    assert (_starts(tmp_path, "worker0"), _starts(tmp_path, "ps0"), _starts(tmp_path, "worker1")) == (1, 1, 2)
    assert [(r.task, r.action) for r in result.recoveries] == [("worker:1", "restarted")]
    said = sink.texts("launch", "stderr")
    assert (
        len(said) == 1
        and said[0].startswith("worker:1 ")
        and said[0].endswith("; restarted it alone, at its address, while the job went on")
    )
    assert "attempt 0: worker:1" in result.explain()


def test_a_dead_worker_of_a_parameter_server_job_is_left_out_when_it_has_no_restarts(tmp_path):
    # The chief ends the job only once the launcher has reaped worker:1 (and so queued its exit): ending when
    # worker:1 said it would die, the chief's exit raced worker:1's, and won about once in four runs under load.
    body = PS_JOB.replace("{death}", "sys.exit(4)").replace(
        'wait_for("{chief_waits_for}")',
        'wait_for("died")\n'
        '    pid = int(next(f for f in os.listdir(here) if f.startswith("worker1.")).split(".")[1])\n'
        "    while True:\n"
        "        try:\n"
        "            os.kill(pid, 0)\n"
        "        except ProcessLookupError:\n"
        "            break\n"
        "        time.sleep(0.02)",
    )
    result, sink, _ = run(tmp_path, body, workers=2, ps=1, grace_period=0.5)
    assert (result.exit_code, result.failed_task, result.failures) == (0, None, ())
    assert [(r.task, r.returncode, r.action) for r in result.recoveries] == [("worker:1", 4, "left out")]
    assert sink.texts("launch", "stderr") == [
        "worker:1 exit code 4; the job goes on without it (no restarts left, see max_restarts; the coordinator runs "
        "its steps on the other workers)"
    ]


def test_a_dead_chief_of_a_parameter_server_job_still_stops_it(tmp_path):
    body = """
task = json.loads(os.environ["TF_CONFIG"])["task"]
if task == {"type": "worker", "index": 0}:
    sys.exit(6)
time.sleep(60)
"""
    result, _, elapsed = run(tmp_path, body, workers=2, ps=1, grace_period=0.5)
    assert (result.exit_code, result.failed_task, result.recoveries) == (6, "worker:0", ())
    assert elapsed < 10
