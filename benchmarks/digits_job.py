"""The main job's throughput: `stratagem train` (the digits job) on its default strategy against one device.

Runs `stratagem train --epochs E --json` as the README does, alternating the default (no --strategy) and
`--strategy one_device`, `--repeats` times each, every run in its own process, and reads samples/s (training
examples over the training steps' wall time) from each run's JSON. Prints each run with the 1-minute load
average before it, each pair's ratio (default / one device) and their median: on a shared machine the pairs,
run back to back, are the steadier reading.

    .venv/bin/python benchmarks/digits_job.py --repeats 3 --quiet-below 1.5   # on a shared machine
    .venv/bin/python benchmarks/digits_job.py --repeats 3 --args "--batch-size 256"   # flags for both sides
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def wait_for_quiet(below: float | None, patience_s: float = 300.0) -> None:
    """Waits (at most `patience_s`) until the 1-minute load average is under `below` (None: no wait)."""
    deadline = time.monotonic() + patience_s
    while below is not None and os.getloadavg()[0] >= below and time.monotonic() < deadline:
        time.sleep(5)


def run(strategy: str | None, epochs: int, extra: list[str]) -> dict:
    command = [sys.executable, "-m", "stratagem", "train", "--epochs", str(epochs), "--json", *extra]
    if strategy is not None:
        command += ["--strategy", strategy]
    load = os.getloadavg()[0]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{shlex.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout)
    return {
        "strategy": report["strategy"],
        "replicas": report["num_replicas_in_sync"],
        "samples_per_s": report["samples_per_s"],
        "test_accuracy": report["test_accuracy"],
        "load_before": load,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side (default 3)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--args", default="", help="more `stratagem train` flags for both sides, as one string")
    parser.add_argument(
        "--quiet-below",
        type=float,
        default=None,
        help="before each pair, wait up to 5 minutes for the 1-minute load average to fall under this",
    )
    args = parser.parse_args()
    extra = shlex.split(args.args)
    ratios = []
    for repeat in range(args.repeats):
        # Which side goes first alternates, so a load that rises or falls through the run favours neither.
        order = (None, "one_device") if repeat % 2 == 0 else ("one_device", None)
        pair = {}
        wait_for_quiet(args.quiet_below)
        for strategy in order:
            result = run(strategy, args.epochs, extra)
            pair[strategy] = result
            print(
                f"{'default' if strategy is None else strategy:10s} {result['strategy']} x{result['replicas']}: "
                f"{result['samples_per_s']:8.0f} samples/s, test accuracy {result['test_accuracy']:.4f}, "
                f"load before {result['load_before']:.2f}",
                flush=True,
            )
        ratios.append(pair[None]["samples_per_s"] / pair["one_device"]["samples_per_s"])
        print(f"  pair {repeat + 1}: default / one_device = {ratios[-1]:.3f}", flush=True)
    print(f"median ratio {statistics.median(ratios):.3f} (pairs: {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
