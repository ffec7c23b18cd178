"""Issue 2's benchmark: plain PyTorch vs stratagem OneDevice and Mirrored (1 and 2 logical CPU replicas).

    .venv/bin/python benchmarks/core.py                 # both workloads, 3 rounds, 20 warm-up + 200 steps
    .venv/bin/python benchmarks/core.py --rounds 1 --steps 50 --workloads mlp
    .venv/bin/python benchmarks/core.py --workloads mlp --interleaved 20   # one process, blocks alternating

Prints a Markdown table of samples/s and ratios to plain PyTorch (same run), and writes JSON.

--interleaved N runs plain PyTorch and Mirrored x2 in one process instead, N blocks of 20 steps each,
alternating (plain first in even blocks, Mirrored first in odd ones), so a disturbance from other work
on a shared machine hits both sides; it prints each side's ms/step and the median of the per-block
ratios, and the share of the cores other processes used during each block.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from stratagem.bench.suite import Config, render_markdown, run_suite, suite_parser

CONFIGS = [
    Config("one_device", ("one_device",)),
    Config("mirrored x1", ("mirrored", "--replicas", "1")),
    Config("mirrored x2", ("mirrored", "--replicas", "2")),
]


def interleaved(workload_name: str, blocks: int, warmup: int, block_steps: int = 20) -> dict:
    """Plain PyTorch and Mirrored x2 in this process, `blocks` alternating blocks of `block_steps` steps."""
    import torch

    import stratagem as sg
    from stratagem.bench.throughput import _registry, make_train_step, strategy_steps
    from stratagem.bench.workloads import WORKLOADS

    workload = WORKLOADS[workload_name]
    batches = workload.make_batches()
    plain = workload.build_model()
    plain_step = make_train_step(plain, workload.build_optimizer(plain))
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=_registry(2))
    sides = {
        "plain": lambda i: plain_step(*batches[i % len(batches)]),
        "mirrored x2": strategy_steps(strategy, workload),
    }
    for run in sides.values():
        for i in range(warmup):
            run(i)
    seconds = {name: [] for name in sides}
    others = []
    for block in range(blocks):
        order = list(sides) if block % 2 == 0 else list(sides)[::-1]
        busy0, wall0 = _busy_seconds(), time.perf_counter()
        for name in order:
            t0 = time.perf_counter()
            for i in range(block * block_steps, (block + 1) * block_steps):
                sides[name](i)
            seconds[name].append(time.perf_counter() - t0)
        busy1, wall1 = _busy_seconds(), time.perf_counter()
        others.append(
            None
            if busy0 is None or busy1 is None
            else ((busy1[0] - busy0[0]) - (busy1[1] - busy0[1])) / ((wall1 - wall0) * (os.cpu_count() or 1))
        )
    strategy.close()
    ratios = [p / m for p, m in zip(seconds["plain"], seconds["mirrored x2"])]
    return {
        "workload": workload_name,
        "threads_plain": torch.get_num_threads(),
        "ms_per_step": {n: 1e3 * sum(t) / (blocks * block_steps) for n, t in seconds.items()},
        "ratio_median": statistics.median(ratios),
        "ratio_total": sum(seconds["plain"]) / sum(seconds["mirrored x2"]),
        "ratios": ratios,
        "other_load": others,
    }


def _busy_seconds() -> tuple[float, float] | None:
    """(CPU seconds every process used, CPU seconds this one used) so far; None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            mine = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    return busy / hz, (int(mine[11]) + int(mine[12])) / hz


def main() -> int:
    parser = suite_parser(__doc__, Path("bench-results/core.json"))
    parser.add_argument(
        "--interleaved",
        type=int,
        metavar="BLOCKS",
        default=0,
        help="plain vs Mirrored x2 in one process, BLOCKS alternating blocks of 20 steps",
    )
    args = parser.parse_args()
    if args.interleaved:
        results = [interleaved(w, args.interleaved, args.warmup) for w in args.workloads.split(",")]
        for r in results:
            quiet = sum(1 for o in r["other_load"] if o is not None and o < 0.1)
            print(
                f"{r['workload']}: plain {r['ms_per_step']['plain']:.2f} ms/step, mirrored x2 "
                f"{r['ms_per_step']['mirrored x2']:.2f} ms/step; ratio median {r['ratio_median']:.3f} "
                f"(total {r['ratio_total']:.3f}) over {len(r['ratios'])} blocks, {quiet} of them with other "
                "processes under 10% of the cores"
            )
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        return 0
    rows = run_suite(
        CONFIGS,
        args.workloads.split(","),
        rounds=args.rounds,
        warmup=args.warmup,
        steps=args.steps,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(render_markdown(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([r.to_dict() for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
