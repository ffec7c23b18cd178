"""What BatchNorm over the global batch costs: a BatchNorm CNN (3 BatchNorm layers, batch 64 of
3x32x32) on 2 logical CPU replicas with batch_norm="global" against batch_norm="per_replica".

    .venv/bin/python benchmarks/batch_norm.py            # 5 blocks of 20 steps each, alternating
    .venv/bin/python benchmarks/batch_norm.py --blocks 3

The two settings run in one process, in alternating blocks (per-replica first in odd blocks), so a
disturbance from other work on a shared machine hits both; prints each side's median ms/step and
the median of the per-block ratios global / per-replica.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from stratagem.devices import DeviceRegistry


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 64, bias=False), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10),
    )


def setup(mode: str, data: list) -> tuple:
    registry = DeviceRegistry()
    registry.set_logical_device_configuration("cpu", 2)
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=registry, batch_norm=mode)
    model = net()
    model, optimizer = strategy.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def step(x, y):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    batches = list(strategy.distribute_dataset(data))
    strategy.run(step, args=batches[0])  # warm-up
    return strategy, step, batches


def block(strategy, step, batches, steps: int) -> float:
    start = time.perf_counter()
    for i in range(steps):
        strategy.run(step, args=batches[i % len(batches)])
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(10)]
    sides = {mode: setup(mode, data) for mode in ("global", "per_replica")}
    times: dict[str, list[float]] = {mode: [] for mode in sides}
    for b in range(args.blocks):
        order = ["global", "per_replica"] if b % 2 == 0 else ["per_replica", "global"]
        for mode in order:
            times[mode].append(block(*sides[mode], args.steps))
    for mode, values in times.items():
        print(f"batch_norm={mode!r}: median {statistics.median(values) * 1000:.1f} ms/step "
              f"(blocks: {', '.join(f'{v * 1000:.0f}' for v in values)})")
    ratios = [g / p for g, p in zip(times["global"], times["per_replica"])]
    print(f"global / per_replica: median ratio {statistics.median(ratios):.3f} over {args.blocks} blocks")
    for strategy, _, _ in sides.values():
        strategy.close()


if __name__ == "__main__":
    main()
