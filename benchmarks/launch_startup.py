"""Start-up of `stratagem launch --workers 2` against `torchrun --nproc-per-node 2`, on a script that only
notes the time it started: the wall time until every task has started and until the launcher has
returned, and the launcher process's peak resident memory.

    .venv/bin/python benchmarks/launch_startup.py              # 5 repeats of each, alternating
    .venv/bin/python benchmarks/launch_startup.py --repeats 9

Each launch runs in a fresh Python process that calls the launcher's own entry point
(`stratagem.cli.main.main` or `torch.distributed.run.main`) and then reads its own peak RSS
(`getrusage(RUSAGE_SELF).ru_maxrss`: the launcher alone, not its tasks). The two launchers alternate,
so that other work on a shared machine hits both; medians and ranges are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TASK = "import os, time\nopen(os.environ['MARK_DIR'] + '/' + os.environ['RANK'], 'w').write(repr(time.time()))\n"

LAUNCHERS = {
    "stratagem launch": "from stratagem.cli.main import main\nrc = main(['launch', '--workers', '2', {script!r}])\n",
    "torchrun": (
        "from torch.distributed.run import main\n"
        "main(['--nproc-per-node', '2', '--master-port', '0', {script!r}])\nrc = 0\n"
    ),
}
WRAPPER = (
    "import json, resource, sys\n{body}print(json.dumps({{'rc': rc, 'maxrss_kib': "
    "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}), file=sys.stderr)\n"
)


def launch_once(name: str, script: Path, marks: Path) -> dict:
    for old in marks.iterdir():
        old.unlink()
    code = WRAPPER.format(body=LAUNCHERS[name].format(script=str(script)))
    env = {**os.environ, "MARK_DIR": str(marks)}
    start = time.time()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    finished = time.time() - start
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    report = json.loads(done.stderr.strip().splitlines()[-1])
    started = [float(p.read_text()) for p in marks.iterdir()]
    if len(started) != 2:
        raise RuntimeError(f"{name}: {len(started)} of 2 tasks started")
    return {"started_s": max(started) - start, "finished_s": finished, "maxrss_mib": report["maxrss_kib"] / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in LAUNCHERS}
    with tempfile.TemporaryDirectory() as tmp:
        script, marks = Path(tmp) / "task.py", Path(tmp) / "marks"
        script.write_text(TASK)
        marks.mkdir()
        for r in range(args.repeats):
            for name in list(LAUNCHERS) if r % 2 == 0 else list(LAUNCHERS)[::-1]:
                results[name].append(launch_once(name, script, marks))
    print("| launcher | all tasks started (s) | launcher returned (s) | launcher peak RSS (MiB) |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        cells = []
        for key in ("started_s", "finished_s", "maxrss_mib"):
            values = [run[key] for run in runs]
            cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    ours, theirs = results["stratagem launch"], results["torchrun"]
    diff = [o["started_s"] - t["started_s"] for o, t in zip(ours, theirs)]
    print(
        f"\nstratagem launch - torchrun, all tasks started: median {statistics.median(diff):+.2f} s "
        f"over {args.repeats} pairs (range {min(diff):+.2f} to {max(diff):+.2f})"
    )


if __name__ == "__main__":
    main()
