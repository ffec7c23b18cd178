"""End to end: the same script on every task, under `stratagem launch --workers 2 --ps 1`, and a worker killed with SIGKILL."""

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
from stratagem.cluster import free_ports, launch

SCRIPT = str(Path(__file__).parent / "workers" / "ps_train.py")
pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(120)
def test_launch_runs_the_same_script_on_chief_worker_and_ps(tmp_path):
    lines: list[str] = []
    env = dict(
        environ.current(),
        PS_TEST_STEPS="30",
        PS_TEST_OUT=str(tmp_path / "losses.json"),
        PS_TEST_CHECKPOINT=str(tmp_path / "ckpt.pt"),
        # Steps of 0.2 s: worker:0 (inside the chief) alone would need 6 s, time enough for worker:1's
        # process to start (importing torch) and take some, even on a loaded machine.
        PS_TEST_STEP_SLEEP="0.2",
    )
    result = launch(
        [sys.executable, SCRIPT],
        workers=2,
        ps=1,
        env=env,
        sink=lambda line: lines.append(f"[{line.task}] {line.text}"),
        timeout=100,
    )
    assert result.ok, result.explain() + "\n" + "\n".join(lines[-40:])
    losses = json.loads((tmp_path / "losses.json").read_text())["losses"]
    assert len(losses) == 30
    assert any("step done on worker:0" in line for line in lines), "worker 0 (inside the chief) ran steps"
    assert any("step done on worker:1" in line for line in lines), "worker 1 ran steps"
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5])
    assert (tmp_path / "ckpt.pt").is_file()  # resuming from it is tested in-process (test_ps_coordinator)


def _start(env: dict[str, str], task: str, out: queue.Queue) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )

    def pump() -> None:
        for line in process.stdout:
            out.put((task, line.rstrip()))

    threading.Thread(target=pump, daemon=True).start()
    return process


@pytest.mark.timeout(150)
def test_sigkilled_worker_functions_run_again_and_training_completes(tmp_path):
    ports = free_ports(4)
    addresses = {
        "chief": [f"127.0.0.1:{ports[0]}"],
        "worker": [f"127.0.0.1:{p}" for p in ports[1:3]],
        "ps": [f"127.0.0.1:{ports[3]}"],
    }
    base = {
        k: v
        for k, v in environ.current().items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    base.update(
        STRATAGEM_CLUSTER_TOKEN="sigkill-test",
        PYTHONUNBUFFERED="1",
        PS_TEST_STEPS="50",
        PS_TEST_STEP_SLEEP="0.2",
        PS_TEST_PS_EXIT_DELAY="0",
        PS_TEST_CHIEF_TIMEOUT="8",
        PS_TEST_OUT=str(tmp_path / "losses.json"),
    )

    def env_for(kind: str, index: int) -> dict[str, str]:
        return dict(base, TF_CONFIG=json.dumps({"cluster": addresses, "task": {"type": kind, "index": index}}))

    output: queue.Queue = queue.Queue()
    log: list[str] = []
    processes = {
        f"{k}:{i}": _start(env_for(k, i), f"{k}:{i}", output)
        for k, i in (("ps", 0), ("worker", 0), ("worker", 1), ("chief", 0))
    }
    try:
        deadline = time.monotonic() + 90
        done_on_1 = 0
        while done_on_1 < 3:  # let worker:1 run a few steps, then kill it mid-training
            task, line = output.get(timeout=max(0.1, deadline - time.monotonic()))
            log.append(f"[{task}] {line}")
            done_on_1 += "step done on worker:1" in line
        killed_at = len(log)
        processes["worker:1"].send_signal(signal.SIGKILL)
        processes["worker:1"].wait(10)
        time.sleep(1.0)
        processes["worker:1"] = _start(env_for("worker", 1), "worker:1", output)  # it comes back
        returncode = processes["chief:0"].wait(90)
        while not output.empty():
            log.append("[{}] {}".format(*output.get()))
        assert returncode == 0, "\n".join(log[-60:])
        losses = json.loads((tmp_path / "losses.json").read_text())["losses"]
        assert len(losses) == 50
        assert sum(losses[-5:]) < 0.7 * sum(losses[:5])
        after_kill = log[killed_at:]
        assert any(
            "[chief:0] worker:1 unreachable; train_step" in line and "goes back to the queue" in line
            for line in after_kill
        ), "\n".join(log[-60:])
        assert any("step done on worker:0" in line for line in after_kill)
        codes = {}
        for name in ("worker:0", "worker:1", "ps:0"):
            try:
                codes[name] = processes[name].wait(30)
            except subprocess.TimeoutExpired:
                codes[name] = "still running"
        while not output.empty():
            log.append("[{}] {}".format(*output.get()))
        # The restarted worker:1 exits when the chief ends the job; if it came up only after the chief had
        # finished (a loaded machine), it exits on its own once the chief is unreachable, naming it.
        lost_chief = any(line.startswith("[worker:1]") and "worker:1 lost the chief: chief:0" in line for line in log)
        assert codes["worker:0"] == 0 and codes["ps:0"] == 0, f"{codes}\n" + "\n".join(log[-60:])
        assert codes["worker:1"] == 0 or (codes["worker:1"] == 1 and lost_chief), f"{codes}\n" + "\n".join(log[-60:])
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait(10)
