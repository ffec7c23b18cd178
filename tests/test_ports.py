"""Porting a plain PyTorch script: strategy.step, strategy.print/is_chief, sg.strategy_from_env, and the ports.

examples/ports/ holds two plain PyTorch scripts and their stratagem ports; each port must stay within
a few changed lines of its original and learn under OneDevice, Mirrored x2 and `stratagem launch --workers 2`.
"""

from __future__ import annotations

import difflib
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import stratagem as sg
from stratagem.cli.main import main as cli_main
from stratagem.strategies.parameter_server.strategy import ParameterServerStrategy

ROOT = Path(__file__).resolve().parent.parent
PORTS = ROOT / "examples" / "ports"
MAX_CHANGED = {"mnist": 20, "nlp": 16}
# The count `diff -u original port | grep -c '^[-+][^-+]'` gives: changed lines that are not blank.
CHANGED_LINE = re.compile(r"^[-+][^-+]")
MNIST_ARGS = ["--epochs", "2", "--batch-size", "32", "--log-interval", "1000"]
NLP_ARGS = ["--num-epochs", "2", "--cpu"]
MNIST_ACCURACY = re.compile(r"Test set: Average loss: [0-9.]+, Accuracy: \d+/\d+ \(([0-9.]+)%\)")
NLP_ACCURACY = re.compile(r"epoch \d+: accuracy ([0-9.]+)")


def changed_lines(name: str) -> int:
    original = (PORTS / f"{name}_original.py").read_text().splitlines()
    port = (PORTS / f"{name}_port.py").read_text().splitlines()
    diff = difflib.unified_diff(original, port, "original", "port", lineterm="")
    return sum(1 for line in diff if CHANGED_LINE.match(line))


@pytest.mark.parametrize("name", sorted(MAX_CHANGED))
def test_each_port_changes_few_lines(name: str) -> None:
    assert 0 < changed_lines(name) <= MAX_CHANGED[name]


# ---- the ports learn ---------------------------------------------------------------------------
def run_original(script: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    """Runs examples/ports/`script` (an unported original) in its own process; its exit code is checked."""
    done = subprocess.run(
        [sys.executable, str(PORTS / script), *args], cwd=ROOT, capture_output=True, text=True, timeout=200, check=False
    )
    assert done.returncode == 0, done.stderr
    return done


def run_in_process(
    script: Path,
    args: list[str],
    env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> str:
    for name in ("STRATAGEM_STRATEGY", "STRATAGEM_DEVICES", "TF_CONFIG", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    capsys.readouterr()  # only what the script prints comes back
    namespace = runpy.run_path(str(script), run_name="__main__")
    strategy = namespace.get("strategy")
    if strategy is not None and hasattr(strategy, "close"):
        strategy.close()
    return capsys.readouterr().out


IN_PROCESS = {
    "one_device": {"STRATAGEM_STRATEGY": "one_device", "STRATAGEM_DEVICES": "cpu:0"},
    "mirrored_x2": {"STRATAGEM_STRATEGY": "mirrored", "STRATAGEM_DEVICES": "cpu:0,cpu:1"},
}


def final_accuracy(pattern: re.Pattern[str], out: str, expected_lines: int) -> float:
    found = [float(m.group(1)) for m in pattern.finditer(out)]
    assert len(found) == expected_lines, f"expected {expected_lines} accuracy lines, got:\n{out}"
    return found[-1]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", sorted(IN_PROCESS))
def test_mnist_port_learns(mode: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_in_process(PORTS / "mnist_port.py", MNIST_ARGS, IN_PROCESS[mode], monkeypatch, capsys)
    assert final_accuracy(MNIST_ACCURACY, out, 2) > 60.0  # ten classes: chance is 10%


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", sorted(IN_PROCESS))
def test_nlp_port_learns(mode: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_in_process(PORTS / "nlp_port.py", NLP_ARGS, IN_PROCESS[mode], monkeypatch, capsys)
    assert final_accuracy(NLP_ACCURACY, out, 2) > 0.8  # two balanced classes: chance is 0.5


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("name", "args", "pattern", "threshold"),
    [
        ("mnist", MNIST_ARGS, MNIST_ACCURACY, 60.0),
        ("nlp", NLP_ARGS, NLP_ACCURACY, 0.8),
    ],
    ids=["mnist", "nlp"],
)
def test_port_learns_under_launch_with_two_workers(
    name: str, args: list[str], pattern: re.Pattern[str], threshold: float
) -> None:
    command = [
        sys.executable,
        "-m",
        "stratagem",
        "launch",
        "--workers",
        "2",
        "--timeout",
        "360",
        str(PORTS / f"{name}_port.py"),
        *args,
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=390, check=False)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    chief = "\n".join(line for line in done.stdout.splitlines() if line.startswith("[worker:0] "))
    assert final_accuracy(pattern, chief, 2) > threshold
    # strategy.print writes from the chief only.
    assert not any(line.startswith("[worker:1] ") for line in done.stdout.splitlines()), done.stdout


# ---- strategy.step -------------------------------------------------------------------------------
def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    # 7 and 5 examples: the two replicas get unequal slices, so the weighting matters.
    return [
        (torch.randn(n, 4, generator=generator, dtype=torch.float64), torch.randint(0, 3, (n,), generator=generator))
        for n in (7, 5, 7)
    ]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3).double()


def test_step_trains_as_one_device_and_returns_the_global_mean_loss() -> None:
    plain = _model()
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)
    plain_losses = []
    for x, y in _batches():
        plain_optimizer.zero_grad()
        loss = F.cross_entropy(plain(x), y)
        loss.backward()
        plain_optimizer.step()
        plain_losses.append(loss.item())

    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    start = _model()
    model, optimizer = strategy.distribute(start, torch.optim.SGD(start.parameters(), lr=0.5))

    @strategy.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    losses = [train_step(x, y).item() for x, y in _batches()]
    assert losses == pytest.approx(plain_losses, abs=1e-12)
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(mine, theirs, atol=1e-9, rtol=0)


def test_step_gathers_sums_or_keeps_per_replica_values() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    x = torch.arange(5.0).reshape(5, 1)
    assert torch.equal(strategy.step(lambda t: t * 2, returns="gather")(x), x * 2)
    assert strategy.step(lambda t: t.sum(), returns="sum")(x).item() == 10.0
    per_replica = strategy.step(lambda t: t.shape[0], returns="per_replica")(x)
    assert strategy.experimental_local_results(per_replica) == (3, 2)
    # Arguments without a tensor reach every replica as they are.
    assert strategy.step(lambda k: torch.tensor(float(k)), returns="sum")(4).item() == 8.0


def test_step_returns_results_where_the_batch_lives() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    out = strategy.step(lambda t: {"double": t * 2, "mean": t.mean()}, returns="gather")(torch.ones(4, 2))
    assert out["double"].shape == (4, 2) and out["double"].device == torch.device("cpu")


def test_step_refuses_an_unknown_way_to_combine() -> None:
    strategy = sg.OneDeviceStrategy("cpu:0")
    with pytest.raises(sg.InputError, match="Unknown way to combine the replicas' results. Received: returns='max'"):
        strategy.step(returns="max")
    with pytest.raises(sg.InputError, match="step\\(\\) needs the function to run once per replica. Received: int"):
        strategy.step(3)


def test_step_under_the_parameter_server_says_what_to_use() -> None:
    # The refusal needs no cluster: it is a property of the strategy's model of execution.
    strategy = object.__new__(ParameterServerStrategy)
    with pytest.raises(sg.InputError, match="step has no meaning under ParameterServerStrategy.*sg.fit"):
        strategy.step(lambda: None)


def test_print_writes_in_the_chief_only(capsys: pytest.CaptureFixture[str]) -> None:
    chief = sg.OneDeviceStrategy("cpu:0")
    chief.print("from the chief", 1)
    worker = object.__new__(sg.MultiWorkerMirroredStrategy)
    worker._group = _rank_one_plan()  # what is_chief reads: rank 1 of 2 (the plan says it as the group would)
    assert chief.is_chief and not worker.is_chief
    worker.print("from worker 1")
    assert capsys.readouterr().out == "from the chief 1\n"


def _rank_one_plan():
    from stratagem.cluster.worker_group import plan_worker_group

    return plan_worker_group(
        None,
        timeout=60,
        env={
            "RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
        },
    )


# ---- strategy_from_env ---------------------------------------------------------------------------
def test_strategy_from_env_builds_the_named_strategy_on_the_named_devices() -> None:
    strategy = sg.strategy_from_env({"STRATAGEM_STRATEGY": "mirrored", "STRATAGEM_DEVICES": "cpu:0, cpu:1"})
    assert isinstance(strategy, sg.MirroredStrategy) and strategy.num_replicas_in_sync == 2
    assert isinstance(sg.strategy_from_env({"STRATAGEM_STRATEGY": "one_device"}), sg.OneDeviceStrategy)


def test_strategy_from_env_without_a_launcher_is_mirrored_over_the_defaults() -> None:
    strategy = sg.strategy_from_env({})
    assert type(strategy) is sg.MirroredStrategy and strategy.num_replicas_in_sync == 1  # no GPU here: the CPU


def test_strategy_from_env_refuses_an_unknown_name() -> None:
    with pytest.raises(sg.InputError, match="Unknown strategy. Received: STRATAGEM_STRATEGY='mirored'"):
        sg.strategy_from_env({"STRATAGEM_STRATEGY": "mirored"})


def test_strategy_from_env_refuses_empty_devices() -> None:
    with pytest.raises(sg.InputError, match="STRATAGEM_DEVICES names no device. Received: STRATAGEM_DEVICES=' , '"):
        sg.strategy_from_env({"STRATAGEM_DEVICES": " , "})


def test_strategy_from_env_refuses_a_one_process_strategy_in_a_cluster() -> None:
    env = {
        "STRATAGEM_STRATEGY": "mirrored",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    with pytest.raises(
        sg.InputError,
        match="STRATAGEM_STRATEGY=mirrored trains in one process, but this process is worker:1 of a cluster of 2",
    ):
        sg.strategy_from_env(env)


def test_launch_refuses_a_one_process_strategy_for_several_workers(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["launch", "--strategy", "mirrored", "--workers", "2", str(PORTS / "mnist_port.py")])
    assert code == 2
    assert "--strategy mirrored trains in one process, so each of the 2 tasks" in capsys.readouterr().err


def test_launch_exports_the_strategy_for_strategy_from_env() -> None:
    from stratagem.cluster.launch import task_environments

    envs = task_environments({}, workers=1, ports=[5000], token="t", strategy="mirrored")
    assert envs["worker:0"]["STRATAGEM_STRATEGY"] == "mirrored"
    assert "STRATAGEM_STRATEGY" not in task_environments({}, workers=1, ports=[5000], token="t")["worker:0"]
    env = dict(envs["worker:0"], STRATAGEM_DEVICES="cpu:0,cpu:1")
    assert sg.strategy_from_env(env).num_replicas_in_sync == 2  # one worker: a one-process strategy is allowed
