"""One readiness check for a GPU machine: every CUDA path stratagem has, in one command.

    PYTHONPATH=src python tests/gpu/check_readiness.py --out DIR             # on a GPU machine
    PYTHONPATH=src python tests/gpu/check_readiness.py --out DIR --dry-run   # each section's CPU part
    PYTHONPATH=src python tests/gpu/check_readiness.py --out DIR --only nccl_wait doctor

Writes DIR/readiness.json (every section PASS or FAIL, with its figures, and the traceback of a
failure) and DIR/readiness.log (everything the sections printed). Each section runs in its own
process with its own time limit, so one that crashes (a CUDA error that poisons the context, a
segfault, a hang) is reported as FAIL and the others still run. The whole run stays within
``--budget`` seconds (default 450, under 8 minutes); exits 1 when any section failed.

Sections (readiness_sections.py, readiness_training.py, readiness_sharded.py): nccl_wait,
cpu_first_reduction, doctor, equivalence, overhead, memory, existing_scripts, sharded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "src"))

import readiness_sections  # noqa: E402  (after the path set-up above)
import readiness_sharded  # noqa: E402
import readiness_training  # noqa: E402

SECTIONS: dict[str, tuple[Any, float]] = {
    # name: (function(ctx) -> figures, seconds it may take on a GPU machine)
    "nccl_wait": (readiness_sections.nccl_wait, 60),
    "cpu_first_reduction": (readiness_sections.cpu_first_reduction, 60),
    "doctor": (readiness_sections.doctor, 150),
    "equivalence": (readiness_training.equivalence, 150),
    "overhead": (readiness_training.overhead, 150),
    "memory": (readiness_sections.memory, 90),
    "existing_scripts": (readiness_sections.existing_scripts, 300),
    "sharded": (readiness_sharded.sharded, 240),
}


class Context:
    """What a section gets: the mode, where to write, and `case` to run sub-checks that fail independently."""

    def __init__(self, out: Path, dry_run: bool, name: str = "") -> None:
        self.out = out
        self.dry_run = dry_run
        self.cases: list[dict[str, Any]] = []
        self._partial = out / "sections" / f"{name}.partial.json" if name else None

    def _save_partial(self) -> None:
        # What is done so far, for the report when the section's process is killed at its time limit.
        if self._partial is not None:
            self._partial.parent.mkdir(parents=True, exist_ok=True)
            self._partial.write_text(json.dumps(self.cases, indent=2, default=str))

    def case(self, name: str, fn: Any) -> Any:
        """Runs one sub-check; its failure is recorded (with the traceback) and the section goes on."""
        start = time.perf_counter()
        try:
            figures = fn()
            self.cases.append(
                {"name": name, "status": "PASS", "seconds": round(time.perf_counter() - start, 2), "figures": figures}
            )
            print(f"  [PASS] {name}: {figures}", flush=True)
            self._save_partial()
            return figures
        except Exception as error:  # noqa: BLE001 - a readiness check reports every failure
            self.cases.append(
                {
                    "name": name,
                    "status": "FAIL",
                    "seconds": round(time.perf_counter() - start, 2),
                    "error": f"{type(error).__name__}: {error}",
                    "traceback": traceback.format_exc(),
                }
            )
            print(f"  [FAIL] {name}: {type(error).__name__}: {error}\n{traceback.format_exc()}", flush=True)
            self._save_partial()
            return None


def run_section(name: str, out: Path, dry_run: bool) -> dict[str, Any]:
    """Runs one section in this process; the record written to out/sections/NAME.json."""
    fn, _ = SECTIONS[name]
    ctx = Context(out, dry_run, name)
    start = time.perf_counter()
    record: dict[str, Any] = {"name": name, "dry_run": dry_run}
    try:
        figures = fn(ctx)
        failed = [c["name"] for c in ctx.cases if c["status"] == "FAIL"]
        record.update(status="FAIL" if failed else "PASS", figures=figures)
        if failed:
            record["error"] = f"{len(failed)} case(s) failed: {', '.join(failed)}"
            record["traceback"] = "\n".join(c["traceback"] for c in ctx.cases if c["status"] == "FAIL")
    except Exception as error:  # noqa: BLE001 - reported as the section's failure
        record.update(status="FAIL", error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc())
    record["cases"] = ctx.cases
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record


def run_isolated(name: str, out: Path, dry_run: bool, limit: float) -> dict[str, Any]:
    """Runs one section in a child process with a time limit; a crash or a hang becomes a FAIL record."""
    sections = out / "sections"
    sections.mkdir(parents=True, exist_ok=True)
    result_path, log_path = sections / f"{name}.json", sections / f"{name}.log"
    result_path.unlink(missing_ok=True)
    (sections / f"{name}.partial.json").unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--out", str(out), "--section", name]
    if dry_run:
        command.append("--dry-run")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            code = subprocess.run(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=limit, check=False
            ).returncode
        except subprocess.TimeoutExpired:
            code = None
    seconds = round(time.perf_counter() - start, 2)
    if result_path.exists():
        record = json.loads(result_path.read_text())
        record["process_seconds"] = seconds
        return record
    tail = log_path.read_text(errors="replace")[-6000:]
    why = f"ran past its {limit:.0f} s limit" if code is None else f"exited with code {code} before reporting"
    partial = sections / f"{name}.partial.json"
    cases = json.loads(partial.read_text()) if partial.exists() else []  # the cases it finished
    return {
        "name": name,
        "dry_run": dry_run,
        "status": "FAIL",
        "error": f"the section's process {why}",
        "traceback": tail,
        "cases": cases,
        "seconds": seconds,
    }


def machine() -> dict[str, Any]:
    """What this machine is, for the report (never raises)."""
    info: dict[str, Any] = {"host": platform.node(), "python": platform.python_version()}
    try:
        import torch

        info.update(torch=torch.__version__, cuda=torch.version.cuda, cpu_threads=torch.get_num_threads())
        if torch.cuda.is_available():
            info.update(gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
    except Exception as error:  # noqa: BLE001 - the report says what could not be read
        info["error"] = f"{type(error).__name__}: {error}"
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for readiness.json, readiness.log and sections/")
    parser.add_argument("--dry-run", action="store_true", help="run each section's CPU part (no GPU needed)")
    parser.add_argument("--only", nargs="*", default=None, help="run only these sections")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run the sections in this process (faster to start; a crash then stops the run)",
    )
    parser.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one section in this process
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.section:
        record = run_section(args.section, out, args.dry_run)
        (out / "sections").mkdir(exist_ok=True)
        (out / "sections" / f"{args.section}.json").write_text(json.dumps(record, indent=2, default=str))
        return 0 if record["status"] == "PASS" else 1
    names = args.only or list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    deadline = time.monotonic() + args.budget
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dry_run": args.dry_run,
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "machine": machine(),
        "sections": [],
    }
    with open(out / "readiness.log", "w", encoding="utf-8") as log:
        for name in names:
            left = deadline - time.monotonic()
            if left < 5:
                record = {
                    "name": name,
                    "status": "FAIL",
                    "error": f"not run: the {args.budget:.0f} s budget was spent",
                    "cases": [],
                    "seconds": 0,
                }
            else:
                log.write(f"===== {name}\n")
                log.flush()
                if args.in_process:
                    with contextlib.redirect_stdout(log):
                        record = run_section(name, out, args.dry_run)
                else:
                    record = run_isolated(name, out, args.dry_run, min(SECTIONS[name][1], left))
                    log.write((out / "sections" / f"{name}.log").read_text(errors="replace"))
                log.write(f"===== {name}: {record['status']} ({record.get('seconds')} s)\n")
                log.flush()
            report["sections"].append(record)
            print(
                f"[{record['status']}] {name} ({record.get('seconds')} s)"
                + (f": {record['error']}" if record["status"] == "FAIL" else ""),
                flush=True,
            )
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report["passed"] = sum(r["status"] == "PASS" for r in report["sections"])
    report["failed"] = sum(r["status"] == "FAIL" for r in report["sections"])
    (out / "readiness.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"{report['passed']} passed, {report['failed']} failed; report in {out / 'readiness.json'}", flush=True)
    return 0 if report["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
