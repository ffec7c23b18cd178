"""Issue 39 item 4: each rank's peak RSS while a model is constructed inside `ShardedStrategy.scope()`, against the
bound (1/N of the parameters plus the largest unit, plus 10%) and against building the whole model first.

    PYTHONPATH=src .venv/bin/python benchmarks/sharded_scope.py                  # 2 workers, scope and whole
    PYTHONPATH=src .venv/bin/python benchmarks/sharded_scope.py --workers 3 --ways scope

Each way runs as `stratagem launch --workers N` starts it (the launcher's allocator settings included), on a
50.3M-parameter MLP (12 x Linear(2048, 2048), float32, 192 MiB). The figure is VmHWM minus the RSS just before
the model was built (after the strategy, its process group, FSDP2's code and, unless `--cold`, a first small
model built in a scope, which loads torch's meta kernels and the recorder's code once per process), the peak
reset there (/proc/self/clear_refs), the larger rank. "scope": built inside `strategy.scope()`; "whole": built as usual,
then `strategy.distribute` shards it. Construction only: no step is taken. Times are indicative (shared cores).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from typing import Any

from torch import nn

WIDTH, LAYERS = 2048, 12


def mlp() -> nn.Module:
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def worker(way: str, warm: bool) -> None:
    import stratagem as sg

    strategy = sg.ShardedStrategy()
    import torch.distributed.fsdp  # noqa: F401  (FSDP2's and DTensor's code, imported before the baseline)
    import torch.distributed.tensor  # noqa: F401

    before_warm_up = status("VmRSS")
    if warm:  # torch's meta kernels and the recorder's code load at the first scope of a process, once
        with strategy.scope():
            small = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        del small
    code = status("VmRSS") - before_warm_up
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the peak counts from here
    baseline = status("VmRSS")
    torch.manual_seed(0)
    start = time.perf_counter()
    if way == "scope":
        with strategy.scope():
            net = mlp()
        model = strategy.distribute(net)
    else:
        model = strategy.distribute(mlp())
    seconds = time.perf_counter() - start
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    line = {
        "way": way,
        "rank": strategy.cluster.task_index,
        "peak_over_baseline": status("VmHWM") - baseline,
        "rss_over_baseline": status("VmRSS") - baseline,
        "local_parameter_bytes": local,
        "seconds": seconds,
        "warm_up": code,
    }
    print("SCOPE " + json.dumps(line), flush=True)
    strategy.close()


def run(way: str, workers: int, warm: bool) -> list[dict[str, Any]]:
    from stratagem import environ
    from stratagem.cluster import launch

    lines: list[str] = []
    command = [sys.executable, __file__, "--worker", way] + ([] if warm else ["--cold"])
    env = dict(environ.current())
    result = launch(command, workers=workers, env=env, sink=lambda line: lines.append(line.text), timeout=900)
    rows = [json.loads(t.split("SCOPE ", 1)[1]) for t in lines if "SCOPE " in t]
    if result.exit_code != 0 or len(rows) != workers:
        print(f"{way}: exit code {result.exit_code}", *lines[-30:], sep="\n")
        return []
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ways", nargs="+", default=["scope", "whole"], choices=["scope", "whole"])
    parser.add_argument("--cold", action="store_true", help="no scope before the baseline: its code load counted")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, not args.cold)
        return
    mib = 2**20
    params = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    largest = (WIDTH * WIDTH + WIDTH) * 4
    bound = 1.1 * (params / args.workers + largest)
    print(f"{LAYERS} x Linear({WIDTH}, {WIDTH}): {params / mib:.1f} MiB of parameters; {args.workers} workers; "
          f"bound 1.1 x (1/N + largest unit) = {bound / mib:.1f} MiB")  # fmt: skip
    print("| way | peak over baseline, per rank (MiB) | larger / bound | RSS after (MiB) | local parameters (MiB) | s "
          "| RSS of the warm-up scope (MiB) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for way in args.ways:
        rows = sorted(run(way, args.workers, not args.cold), key=lambda r: r["rank"])
        if not rows:
            continue
        peak = max(r["peak_over_baseline"] for r in rows)

        def each(key: str, scale: float = mib) -> str:
            return ", ".join(f"{r[key] / scale:.1f}" for r in rows)

        print(f"| {way} | {each('peak_over_baseline')} | {peak / bound:.2f} | {each('rss_over_baseline')} | "
              f"{each('local_parameter_bytes')} | {each('seconds', 1)} | {each('warm_up')} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
