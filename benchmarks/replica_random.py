"""What a CPU replica's own random stream costs: a step on 2 logical CPU replicas with each replica but the
first under its generator's dispatch mode (strategies/data_parallel/cpu_threads/replica_random.py), against the same
step with the mode left out (replicas then draw from torch's one generator, in thread order).

    .venv/bin/python benchmarks/replica_random.py             # 5 blocks of 20 steps each, alternating
    .venv/bin/python benchmarks/replica_random.py --blocks 3

Two models: "wide" (784-1024-1024-10 MLP with dropout, batch 256: few, large operators) and "narrow"
(64-64-64-64-10 MLP with dropout, batch 32: many small operators, the worst case for a per-operator
Python call), and "narrow-no-dropout" (the same without dropout: the mode is off after the first step,
so both sides should match). Both settings run in one process, in alternating blocks, so a disturbance from other work
on a shared machine hits both; prints each side's median ms/step and the median of the per-block ratios
with / without.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from stratagem.devices import DeviceRegistry
from stratagem.strategies.data_parallel.cpu_threads.replica_random import ReplicaRandomPart

SIZES = {
    "wide": ([784, 1024, 1024, 10], 256, 0.1),
    "narrow": ([64, 64, 64, 64, 10], 32, 0.1),
    "narrow-no-dropout": ([64, 64, 64, 64, 10], 32, 0.0),
}


def net(widths: list[int], p: float) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-2], widths[1:-1]):
        layers += [nn.Linear(a, b), nn.ReLU(), nn.Dropout(p)]
    return nn.Sequential(*layers, nn.Linear(widths[-2], widths[-1]))


def setup(name: str) -> tuple:
    widths, batch, p = SIZES[name]
    registry = DeviceRegistry()
    registry.set_logical_device_configuration("cpu", 2)
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=registry)
    model = net(widths, p)
    model, optimizer = strategy.distribute(model, torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = torch.randn(batch, widths[0]), torch.randint(0, widths[-1], (batch,))

    def step(x, y):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):
        strategy.run(step, args=(x, y))  # warm-up (the first step decides whether the mode stays on)
    return strategy, step, (x, y)


def block(strategy, step, batch, steps: int, with_streams: bool) -> float:
    original = ReplicaRandomPart.random
    if not with_streams:
        ReplicaRandomPart.random = lambda self, replica: contextlib.nullcontext()  # benchmark only
    try:
        start = time.perf_counter()
        for _ in range(steps):
            strategy.run(step, args=batch)
        return (time.perf_counter() - start) / steps
    finally:
        ReplicaRandomPart.random = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    for name in SIZES:
        strategy, step, batch = setup(name)
        times: dict[bool, list[float]] = {True: [], False: []}
        ratios = []
        for b in range(args.blocks):
            order = (True, False) if b % 2 else (False, True)
            for side in order:
                times[side].append(block(strategy, step, batch, args.steps, side))
            ratios.append(times[True][-1] / times[False][-1])
        strategy.close()
        print(
            f"{name}: with own streams {statistics.median(times[True]) * 1e3:.2f} ms/step, without "
            f"{statistics.median(times[False]) * 1e3:.2f} ms/step, ratio median {statistics.median(ratios):.3f} "
            f"(range {min(ratios):.3f}-{max(ratios):.3f})"
        )


if __name__ == "__main__":
    main()
