"""What combining only the gradients a backward pass reached saves on a GAN step: pytorch/examples' DCGAN iteration
(two discriminator passes while the generator still holds its gradient from the step before, then the generator's
pass through the discriminator) on logical CPU replicas, against the same step with every pass combining every
gradient present (the behaviour before: `LocalCombination.whole_passes` raised for the run, benchmark only).

    .venv/bin/python benchmarks/several_models.py                       # Mirrored x2, 6 blocks of 5 steps
    .venv/bin/python benchmarks/several_models.py --strategy central --replicas 3 --blocks 8

The generator and discriminator are MLPs with BatchNorm (100-256-512-784 and 784-512-256-1, 1.5 M parameters,
float32, batch 64, Adam each). Both settings run in one process, in alternating blocks, so a disturbance from other
work on a shared machine hits both; prints each side's median ms/step and the median (and range) of the per-block
ratios reached-only / every-gradient (below 1: the fix saves).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from stratagem.devices import DeviceRegistry
from stratagem.strategies.data_parallel import set_parts

Z, IMAGE = 100, 784


def mlp(widths: list[int], last: nn.Module) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-2], widths[1:-1]):
        layers += [nn.Linear(a, b, bias=False), nn.BatchNorm1d(b), nn.LeakyReLU(0.2)]
    return nn.Sequential(*layers, nn.Linear(widths[-2], widths[-1]), last)


def setup(kind: str, replicas: int, batch: int) -> tuple:
    registry = DeviceRegistry()
    registry.set_logical_device_configuration("cpu", replicas)
    devices = [f"cpu:{i}" for i in range(replicas)]
    strategy = (
        sg.MirroredStrategy(devices, registry=registry)
        if kind == "mirrored"
        else sg.CentralStorageStrategy(devices, registry=registry)
    )
    torch.manual_seed(0)
    plain_g, plain_d = mlp([Z, 256, 512, IMAGE], nn.Tanh()), mlp([IMAGE, 512, 256, 1], nn.Sigmoid())
    g, opt_g = strategy.distribute(plain_g, torch.optim.Adam(plain_g.parameters(), lr=2e-4, betas=(0.5, 0.999)))
    d, opt_d = strategy.distribute(plain_d, torch.optim.Adam(plain_d.parameters(), lr=2e-4, betas=(0.5, 0.999)))

    def step(real: torch.Tensor, noise: torch.Tensor) -> None:
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        d.zero_grad()
        F.binary_cross_entropy(d(real), ones).backward()
        fake = g(noise)
        F.binary_cross_entropy(d(fake.detach()), zeros).backward()
        opt_d.step()
        g.zero_grad()
        F.binary_cross_entropy(d(fake), ones).backward()
        opt_g.step()

    inputs = next(iter(strategy.distribute_dataset([(torch.rand(batch, IMAGE) * 2 - 1, torch.randn(batch, Z))])))
    for _ in range(2):
        strategy.run(step, args=inputs)  # warm-up
    return strategy, step, inputs


class Meter:
    """CPU seconds spent in the reducer's `combine_` (summed over the replica threads; CPU time, not wall time, so
    waiting for a core on a loaded machine does not count) and gradient elements each meeting combined."""

    def __init__(self, strategy) -> None:
        self.seconds = 0.0
        self.elements = 0
        self._lock = threading.Lock()
        replicas = strategy._replicas  # benchmark only: the replica set's reducer and meeting
        reducer = replicas._combination.combine.reducer
        combination = replicas.combination
        combine_, choose = reducer.combine_, combination._choose

        def timed(replica, grads, weights, **kwargs):
            start = time.thread_time()
            combine_(replica, grads, weights, **kwargs)
            with self._lock:
                self.seconds += time.thread_time() - start

        def counted(current, chosen):
            choose(current, chosen)
            self.elements += sum(replicas.replica_params[0][i].numel() for i in combination.keep)

        reducer.combine_ = timed
        combination._choose = counted


def block(strategy, step, inputs, steps: int, every_gradient: bool) -> float:
    original = set_parts.LocalCombinationPart.begin_step

    def combine_everything(self, state):  # benchmark only: the behaviour before, every present gradient each pass
        original(self, state)
        self.combination.whole_passes = 1 << 30

    if every_gradient:
        set_parts.LocalCombinationPart.begin_step = combine_everything
    try:
        start = time.perf_counter()
        for _ in range(steps):
            strategy.run(step, args=inputs)
        return (time.perf_counter() - start) / steps
    finally:
        set_parts.LocalCombinationPart.begin_step = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["mirrored", "central"], default="mirrored")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=6)
    args = parser.parse_args()
    strategy, step, inputs = setup(args.strategy, args.replicas, args.batch)
    meter = Meter(strategy)
    reached, every, ratios = [], [], []
    combining = {False: [0.0, 0], True: [0.0, 0]}  # seconds, elements: per side, over all its blocks
    try:
        for b in range(args.blocks):
            # Alternate which side goes first, so a drift in load within a pair does not favour one side.
            order = (False, True) if b % 2 == 0 else (True, False)
            times = {}
            for side in order:
                before = (meter.seconds, meter.elements)
                times[side] = block(strategy, step, inputs, args.steps, side)
                combining[side][0] += meter.seconds - before[0]
                combining[side][1] += meter.elements - before[1]
            reached.append(times[False])
            every.append(times[True])
            ratios.append(times[False] / times[True])
    finally:
        strategy.close()
    steps = args.blocks * args.steps
    for side, label in ((False, "reached only"), (True, "every gradient")):
        seconds, elements = combining[side]
        print(
            f"{label}: {elements / steps / 1e6:.2f} M gradient elements combined a step, "
            f"{seconds / steps * 1e3:.2f} CPU ms a step in the reducer (summed over the replica threads)"
        )
    print(
        f"{args.strategy} x{args.replicas}, batch {args.batch}, {args.blocks} blocks of {args.steps} steps: "
        f"reached only {statistics.median(reached) * 1e3:.1f} ms/step, every gradient "
        f"{statistics.median(every) * 1e3:.1f} ms/step, ratio {statistics.median(ratios):.3f} "
        f"({min(ratios):.3f}-{max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
