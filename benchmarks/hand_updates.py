"""What the check that refuses a hand-written update before it runs costs (strategies/data_parallel/cpu_threads/hand_updates.py):
the MLP workload's step on Mirrored x2 (logical CPU devices, shared parameters, SGD) with every replica under the
check, as in the first step, against the same step without it, as in every later step.

    .venv/bin/python benchmarks/hand_updates.py                # 6 blocks of 20 steps each, alternating
    .venv/bin/python benchmarks/hand_updates.py --blocks 10 --steps 10

Both sides run in one process, in alternating blocks, so a disturbance from other work on a shared machine hits
both; prints each side's median ms/step and the median and range of the per-block ratios with / without. The
"with" side forces the check on every step (benchmark only: it marks the watches unchecked before each step).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import stratagem as sg
from stratagem.bench.throughput import _registry, strategy_steps
from stratagem.bench.workloads import WORKLOADS
from stratagem.strategies.data_parallel.cpu_threads.hand_updates import HandUpdateGuard


def block(run: Callable[[int], Any], first: int, steps: int, checked: bool) -> float:
    original = HandUpdateGuard.begin_step

    def every_step(self: HandUpdateGuard) -> None:
        for watch in self._watches:  # benchmark only: as if each step were the first
            watch.checked = False
        original(self)

    if checked:
        HandUpdateGuard.begin_step = every_step  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        for i in range(first, first + steps):
            run(i)
        return (time.perf_counter() - start) / steps
    finally:
        HandUpdateGuard.begin_step = original  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mlp")
    args = parser.parse_args()
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=_registry(2))
    run = strategy_steps(strategy, WORKLOADS[args.workload])
    for i in range(10):
        run(i)  # warm-up, the first step (checked) included
    times: dict[bool, list[float]] = {True: [], False: []}
    ratios = []
    for b in range(args.blocks):
        for side in (True, False) if b % 2 else (False, True):
            times[side].append(block(run, b * args.steps, args.steps, side))
        ratios.append(times[True][-1] / times[False][-1])
    strategy.close()
    print(
        f"{args.workload}, Mirrored x2: under the check {statistics.median(times[True]) * 1e3:.2f} ms/step, "
        f"without {statistics.median(times[False]) * 1e3:.2f} ms/step, ratio median {statistics.median(ratios):.3f} "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}, {args.blocks} blocks of {args.steps} steps)"
    )


if __name__ == "__main__":
    main()
