"""scripts/venv.sh installs only what was asked for: the main job's set, or the tests' set.

The script runs against a copy of the checkout's scripts beside a stand-in `.venv/bin/python` that
records each pip call instead of installing, so the test needs no network and takes a fraction of a second.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def checkout(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "venv.sh", tmp_path / "scripts" / "venv.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copy(ROOT / "requirements-dev.txt", tmp_path / "requirements-dev.txt")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "$*" >> "$(dirname "$0")/../pip-calls"\n')
    python.chmod(0o755)
    return tmp_path


def venv(checkout: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(checkout / "scripts" / "venv.sh"), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PATH": os.environ.get("PATH", "")},
    )


def pip_calls(checkout: Path) -> list[str]:
    calls = checkout / ".venv" / "pip-calls"
    return calls.read_text().splitlines() if calls.exists() else []


def test_the_main_job_gets_the_train_set_only(checkout: Path) -> None:
    assert venv(checkout, "train").returncode == 0
    installs = [c for c in pip_calls(checkout) if "-e" in c.split()]
    assert installs == [f"-m pip install -q -e {checkout}[train]"]


def test_the_tests_get_the_dev_set_and_it_serves_the_main_job_too(checkout: Path) -> None:
    assert venv(checkout).returncode == 0  # dev by default: what scripts/test and CI use
    assert [c for c in pip_calls(checkout) if "-e" in c.split()] == [f"-m pip install -q -e {checkout}[dev]"]
    before = len(pip_calls(checkout))
    assert venv(checkout, "train").returncode == 0
    assert venv(checkout, "dev").returncode == 0
    assert len(pip_calls(checkout)) == before  # nothing installed again


def test_a_train_set_is_completed_when_the_tests_need_more(checkout: Path) -> None:
    venv(checkout, "train")
    assert venv(checkout, "dev").returncode == 0
    assert pip_calls(checkout)[-1] == f"-m pip install -q -e {checkout}[dev]"


def test_an_unknown_set_is_refused_with_the_choices(checkout: Path) -> None:
    result = venv(checkout, "everything")
    assert result.returncode == 2
    assert "unknown set 'everything'" in result.stderr and "'train'" in result.stderr and "'dev'" in result.stderr
    assert pip_calls(checkout) == []


def test_the_readme_commands_ask_for_their_sets() -> None:
    assert 'scripts/venv.sh" train' in (ROOT / "scripts" / "train").read_text()
    assert 'scripts/venv.sh" dev' in (ROOT / "scripts" / "test").read_text()
    train_extra = (ROOT / "pyproject.toml").read_text().split("train = [", 1)[1].split("]", 1)[0]
    assert "transformers" not in train_extra and "mypy" not in train_extra


def test_an_install_says_what_it_is_doing_and_a_ready_venv_says_nothing(checkout: Path) -> None:
    result = venv(checkout, "train")
    assert "scripts/venv.sh: installing stratagem's 'train' set" in result.stderr
    assert "scripts/venv.sh: installed" in result.stderr
    assert venv(checkout, "train").stderr == ""  # nothing to install: the job's own output alone
