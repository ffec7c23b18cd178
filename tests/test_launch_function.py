"""sg.launch: a function run as a local cluster, with stratagem launch's behaviour."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from workers import launch_fns

import stratagem as sg
from stratagem.cluster import OutputLine
from stratagem.errors import ClusterError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_script_launches_its_own_function_and_gets_every_workers_value(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import json, os
        import stratagem as sg

        def work(scale):
            print("rank", os.environ["RANK"], "works")
            return {"rank": int(os.environ["RANK"]), "value": int(os.environ["RANK"]) * scale}

        if __name__ == "__main__":
            print("RESULT " + json.dumps(sg.launch(work, workers=2, args=(5,), timeout=150)))
    """)
    )
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "[worker:0] rank 0 works" in lines and "[worker:1] rank 1 works" in lines
    result = next(line for line in lines if line.startswith("RESULT "))
    assert json.loads(result[len("RESULT ") :]) == [{"rank": 0, "value": 0}, {"rank": 1, "value": 5}]


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_the_first_failure_is_named_and_the_others_stopped() -> None:
    lines: list[OutputLine] = []
    started = time.monotonic()
    with pytest.raises(sg.LaunchError, match=r"worker:1 exit code 1; the other tasks were stopped") as raised:
        sg.launch(
            launch_fns.fail_on_worker_one, workers=2, args=(600.0,), timeout=150, grace_period=1.0, sink=lines.append
        )
    assert time.monotonic() - started < 150  # worker 0 was stopped, not waited for
    assert raised.value.result.failed_task == "worker:1"
    assert any(line.task == "worker:1" and "worker one gives up" in line.text for line in lines)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_launch_past_its_timeout_fails_naming_the_running_tasks() -> None:
    with pytest.raises(sg.LaunchError, match=r"launch timed out after 3 s; still running: worker:0"):
        sg.launch(launch_fns.sleep, workers=1, args=(600.0,), timeout=3, grace_period=1.0, sink=lambda line: None)


def test_a_lambda_is_refused_with_what_to_do() -> None:
    with pytest.raises(
        sg.InputError,
        match="cannot find a lambda or a function defined inside another function.*"
        "Define it at the top level of a .py module",
    ):
        sg.launch(lambda: 1, workers=2)


def test_a_nested_function_is_refused() -> None:
    def inner() -> None:
        return None

    with pytest.raises(sg.InputError, match="Received: test_launch_function.*<locals>.inner"):
        sg.launch(inner, workers=2)


def test_a_notebook_function_is_refused_with_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    notebook = type(sys)("__main__")  # an interactive __main__ has no __file__

    def train() -> None:
        return None

    train.__module__, train.__qualname__ = "__main__", "train"
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    with pytest.raises(
        sg.InputError,
        match="defined in a notebook or an interactive session.*Received: __main__.train. Define it at the top level",
    ):
        sg.launch(train, workers=2)


def test_arguments_that_do_not_pickle_are_refused() -> None:
    with pytest.raises(sg.InputError, match="The function's arguments cannot be sent to a new process"):
        sg.launch(launch_fns.sleep, workers=2, args=(lambda: 0,))


def test_launch_inside_a_task_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATAGEM_CLUSTER_TOKEN", "x")
    with pytest.raises(ClusterError, match="launch\\(\\) was called inside a task of a launch.*__main__"):
        sg.launch(launch_fns.sleep, workers=2, args=(0.0,))


def test_launch_refuses_what_is_not_a_function() -> None:
    with pytest.raises(sg.InputError, match="launch\\(\\) needs a function to run in every task. Received: int"):
        sg.launch(3, workers=2)  # type: ignore[arg-type]
