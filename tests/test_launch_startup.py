"""`stratagem launch` starts its tasks without importing torch, torch.distributed, gRPC or the strategies,
and `import stratagem as sg` still offers every public name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import stratagem as sg
from stratagem.cli.launch import ONE_PROCESS_STRATEGIES, STRATEGY_NAMES
from stratagem.strategies.records import STRATEGIES

SRC = Path(__file__).resolve().parents[1] / "src"
HEAVY = ("torch", "torch.distributed", "grpc", "stratagem.strategies.base", "stratagem.train")
# Every strategy's module: a process imports one of them only when it uses that strategy.
STRATEGY_MODULES = tuple(record.module for record in STRATEGIES)


def test_the_launcher_imports_neither_torch_nor_the_strategies(tmp_path: Path) -> None:
    script = tmp_path / "task.py"
    script.write_text("import os\nprint('task', os.environ['RANK'], 'started')\n")
    probe = (
        "import sys\n"
        "from stratagem.cli.main import main\n"
        f"rc = main(['launch', '--workers', '2', {str(script)!r}])\n"
        f"print('loaded', rc, sorted(m for m in {HEAVY + STRATEGY_MODULES!r} if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert "[worker:0] task 0 started" in done.stdout and "[worker:1] task 1 started" in done.stdout
    # The check runs after the tasks have finished: nothing heavy was imported before they started either.
    assert "loaded 0 []" in done.stdout, done.stdout


def test_the_launchers_strategy_names_are_the_registered_ones() -> None:
    assert STRATEGY_NAMES == STRATEGIES.names
    assert ONE_PROCESS_STRATEGIES == ("mirrored", "one_device", "central_storage", "model_parallel")


def test_reading_the_strategy_records_imports_neither_torch_nor_a_strategy() -> None:
    probe = (
        "import sys\n"
        "from stratagem.strategies.records import STRATEGIES\n"
        "print([r.name for r in STRATEGIES if r.one_process_per_worker])\n"
        f"print(sorted(m for m in {HEAVY + STRATEGY_MODULES!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split("\n")[:2] == ["['multi_worker', 'parameter_server', 'sharded', 'tensor_parallel']", "[]"]


def test_every_public_name_resolves() -> None:
    for name in sg.__all__:
        assert getattr(sg, name) is not None, name
    assert sg.MirroredStrategy.__name__ == "MirroredStrategy" and sg.data.__name__ == "stratagem.data"
    assert set(sg.__all__) <= set(dir(sg))


def test_importing_stratagem_imports_the_rest_when_first_used() -> None:
    probe = (
        "import sys, stratagem as sg\n"
        f"loaded = lambda: sorted(m for m in ('torch', 'stratagem.strategies.base', *{STRATEGY_MODULES!r}) "
        "if m in sys.modules)\n"
        "print(loaded())\n"
        "sg.MirroredStrategy\n"
        "print(loaded())\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    # The first use of one strategy imports that strategy only.
    assert done.stdout.split("\n")[:2] == [
        "[]",
        "['stratagem.strategies.base', 'stratagem.strategies.mirrored', 'torch']",
    ]
