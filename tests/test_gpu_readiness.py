"""The GPU readiness script's dry run: every section's CPU part, end to end, so the script does not rot."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "gpu" / "check_readiness.py"
SECTIONS = [
    "nccl_wait",
    "cpu_first_reduction",
    "doctor",
    "equivalence",
    "overhead",
    "memory",
    "existing_scripts",
    "sharded",
]


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(ROOT),
        check=False,
    )


def test_the_dry_run_passes_every_section_and_writes_its_report(tmp_path):
    result = _run("--out", str(tmp_path), "--dry-run", "--in-process", timeout=400)
    report = json.loads((tmp_path / "readiness.json").read_text())
    failures = {s["name"]: s.get("traceback") for s in report["sections"] if s["status"] != "PASS"}
    assert result.returncode == 0 and not failures, (result.stdout[-3000:], failures)
    assert [s["name"] for s in report["sections"]] == SECTIONS
    assert report["dry_run"] is True and report["passed"] == len(SECTIONS)
    by_name = {s["name"]: s for s in report["sections"]}
    assert by_name["cpu_first_reduction"]["figures"]["max_difference"] == 0.0
    assert by_name["doctor"]["figures"]["0,0"]["doctor_predicts"] == 0
    assert "===== nccl_wait" in (tmp_path / "readiness.log").read_text()


def test_a_section_runs_in_its_own_process_and_a_crash_there_is_a_failure_not_a_stop(tmp_path):
    spec = importlib.util.spec_from_file_location("check_readiness", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    record = module.run_isolated("cpu_first_reduction", tmp_path, True, limit=200)
    assert record["status"] == "PASS", record.get("traceback")
    assert (tmp_path / "sections" / "cpu_first_reduction.log").exists()
    record = module.run_isolated("no_such_section", tmp_path, True, limit=200)
    assert record["status"] == "FAIL"
    assert record["error"] == "the section's process exited with code 1 before reporting"
    assert "KeyError: 'no_such_section'" in record["traceback"]
