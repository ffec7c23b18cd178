"""`stratagem launch` starts its tasks without importing torch, torch.distributed, gRPC or the strategies,
and `import stratagem as sg` still offers every public name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import stratagem as sg
from stratagem.cluster.launch import LAUNCHABLE_STRATEGIES
from stratagem.strategies.records import STRATEGIES

SRC = Path(__file__).resolve().parents[1] / "src"
HEAVY = ("torch", "torch.distributed", "grpc", "stratagem.strategies", "stratagem.train")


def test_the_launcher_imports_neither_torch_nor_the_strategies(tmp_path: Path) -> None:
    script = tmp_path / "task.py"
    script.write_text("import os\nprint('task', os.environ['RANK'], 'started')\n")
    probe = (
        "import sys\n"
        "from stratagem.cli.main import main\n"
        f"rc = main(['launch', '--workers', '2', {str(script)!r}])\n"
        f"print('loaded', rc, sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
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
    assert LAUNCHABLE_STRATEGIES == {record.name: record.one_process_per_worker for record in STRATEGIES}


def test_every_public_name_resolves() -> None:
    for name in sg.__all__:
        assert getattr(sg, name) is not None, name
    assert sg.MirroredStrategy.__name__ == "MirroredStrategy" and sg.data.__name__ == "stratagem.data"
    assert set(sg.__all__) <= set(dir(sg))


def test_importing_stratagem_imports_the_rest_when_first_used() -> None:
    probe = (
        "import sys, stratagem as sg\n"
        "print(sorted(m for m in ('torch', 'stratagem.strategies') if m in sys.modules))\n"
        "sg.MirroredStrategy\n"
        "print(sorted(m for m in ('torch', 'stratagem.strategies') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split("\n")[:2] == ["[]", "['stratagem.strategies', 'torch']"]
