"""What `import stratagem` and the first `sg.MirroredStrategy()` cost on top of `import torch`.

    .venv/bin/python benchmarks/import_time.py              # 7 fresh processes, the median of each figure
    .venv/bin/python benchmarks/import_time.py --runs 15
    .venv/bin/python benchmarks/import_time.py --once       # one process, one line (what each run prints)

Each run is a fresh interpreter that imports torch, then stratagem, then builds ``sg.MirroredStrategy()``
(its default devices) and says which strategies were imported by then: the first use of one strategy
imports that strategy only. Also says whether the heavy modules that load only when used
(torch._dynamo, grpc, torch.distributed.fsdp) were imported; tests/test_architecture.py asserts that
`import stratagem` loads none of them.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

# One module per strategy: imported only when that strategy is used.
STRATEGY_MODULES = (
    "stratagem.strategies.mirrored",
    "stratagem.strategies.one_device",
    "stratagem.strategies.multi_worker.strategy",
    "stratagem.strategies.central_storage.strategy",
    "stratagem.strategies.model_parallel.strategy",
    "stratagem.strategies.parameter_server.strategy",
    "stratagem.strategies.sharded.strategy",
    "stratagem.strategies.tensor_parallel.strategy",
)
HEAVY = ("torch._dynamo", "grpc", "torch.distributed.fsdp")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure_once() -> dict[str, object]:
    """One process's figures, in seconds: this process must not have imported torch yet."""
    cpu0, wall0 = _cpu(), time.perf_counter()
    import torch  # noqa: F401

    cpu1, wall1 = _cpu(), time.perf_counter()
    import stratagem as sg

    cpu2, wall2 = _cpu(), time.perf_counter()
    heavy = [m for m in HEAVY if m in sys.modules]
    sg.MirroredStrategy()
    cpu3, wall3 = _cpu(), time.perf_counter()
    return {
        "torch_cpu": cpu1 - cpu0,
        "torch_wall": wall1 - wall0,
        "stratagem_cpu": cpu2 - cpu1,
        "stratagem_wall": wall2 - wall1,
        "mirrored_cpu": cpu3 - cpu1,
        "mirrored_wall": wall3 - wall1,
        "heavy_after_import": heavy,
        "strategies_after_mirrored": [m for m in STRATEGY_MODULES if m in sys.modules],
    }


def _line(figures: dict[str, object]) -> str:
    return (
        f"import torch: {figures['torch_cpu']:.3f} s CPU, {figures['torch_wall']:.3f} s wall; "
        f"import stratagem on top: {figures['stratagem_cpu']:.3f} s CPU, {figures['stratagem_wall']:.3f} s wall; "
        f"import stratagem and sg.MirroredStrategy() on top: {figures['mirrored_cpu']:.3f} s CPU, "
        f"{figures['mirrored_wall']:.3f} s wall"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="fresh processes to take the median of (default 7)")
    parser.add_argument("--once", action="store_true", help="measure in this process and print one line")
    parser.add_argument("--json", action="store_true", help="with --once: the figures as JSON")
    args = parser.parse_args()
    if args.once:
        figures = measure_once()
        print(json.dumps(figures) if args.json else _line(figures))
        return
    runs = []
    for _ in range(args.runs):
        done = subprocess.run(
            [sys.executable, __file__, "--once", "--json"], capture_output=True, text=True, check=True
        )
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    median = {key: statistics.median(float(r[key]) for r in runs) for key in runs[0] if key.endswith(("cpu", "wall"))}
    print(f"median of {len(runs)} fresh processes: {_line(median)}")
    spread = sorted(float(r["mirrored_wall"]) for r in runs)
    print(f"sg.MirroredStrategy() over import torch, wall, each run: {', '.join(f'{s:.3f}' for s in spread)}")
    print(f"heavy modules loaded by import stratagem: {', '.join(runs[0]['heavy_after_import']) or 'none'}")
    loaded = runs[0]["strategies_after_mirrored"]
    print(f"strategies imported by the first sg.MirroredStrategy(): {len(loaded)} ({', '.join(loaded)})")


if __name__ == "__main__":
    main()
