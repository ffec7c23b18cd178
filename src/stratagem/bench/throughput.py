"""Samples per second of one configuration (plain PyTorch or a stratagem strategy) on a workload.

Each configuration runs in its own process (`python -m stratagem.bench.throughput ...`) so thread
settings and allocator state of one do not leak into the next.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from stratagem.bench.workloads import WORKLOADS, Workload

if TYPE_CHECKING:
    from stratagem.strategies.base import Strategy


@dataclass(frozen=True)
class Measurement:
    config: str
    workload: str
    replicas: int
    steps: int
    elapsed_s: float
    samples_per_s: float
    final_loss: float
    threads: int
    peak_memory_bytes: int | None = None
    """The largest process's (or GPU's) peak memory over what it held before the model (`bench/peak_memory.py`)."""


def make_train_step(
    model: Any, optimizer: torch.optim.Optimizer
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The reference workload's step: zero_grad, cross-entropy, backward, step."""

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return train_step


def strategy_steps(strategy: Strategy, workload: Workload) -> Callable[[int], Any]:
    """Step ``i`` of ``workload`` under ``strategy``: a fresh model distributed, the batches split, ``run``."""
    net = workload.build_model()
    model, optimizer = strategy.distribute(net, workload.build_optimizer(net))
    dataset = list(strategy.distribute_dataset(workload.make_batches()))
    train_step = make_train_step(model, optimizer)
    return lambda i: strategy.run(train_step, args=dataset[i % len(dataset)])


def timed_steps(
    step: Callable[[int], Any], warmup: int, steps: int, barrier: Callable[[], Any] | None = None
) -> tuple[float, Any]:
    """Runs `step(i)` for warm-up then timed steps; returns (seconds of the timed steps, last result).
    `barrier` runs just before the clock starts and stops, so several ranks time the slowest one."""
    result = None
    t0 = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            if barrier is not None:
                barrier()
            t0 = time.perf_counter()
        result = step(i)
    if barrier is not None:
        barrier()
    return time.perf_counter() - t0, result


def measure_plain(workload: Workload, warmup: int, steps: int) -> Measurement:
    model = workload.build_model()
    optimizer = workload.build_optimizer(model)
    batches = workload.make_batches()
    train_step = make_train_step(model, optimizer)
    elapsed, loss = timed_steps(lambda i: train_step(*batches[i % len(batches)]), warmup, steps)
    return Measurement(
        "plain",
        workload.name,
        1,
        steps,
        elapsed,
        steps * workload.global_batch / elapsed,
        float(loss.detach()),
        torch.get_num_threads(),
    )


def measure_strategy(config: str, workload: Workload, replicas: int, warmup: int, steps: int) -> Measurement:
    import stratagem as sg

    strategy: sg.Strategy
    if config == "one_device":
        strategy = sg.OneDeviceStrategy("cpu")
    else:
        strategy = sg.MirroredStrategy([f"cpu:{i}" for i in range(replicas)], registry=_registry(replicas))
    elapsed, loss = timed_steps(strategy_steps(strategy, workload), warmup, steps)
    final = float(strategy.reduce("mean", loss))
    return Measurement(
        config,
        workload.name,
        replicas,
        steps,
        elapsed,
        steps * workload.global_batch / elapsed,
        final,
        torch.get_num_threads(),
    )


def _registry(replicas: int):
    from stratagem.devices import DeviceRegistry

    registry = DeviceRegistry()
    registry.set_logical_device_configuration("cpu", max(replicas, os.cpu_count() or 1))
    return registry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config", choices=["plain", "one_device", "mirrored"])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mlp")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    workload = WORKLOADS[args.workload]
    if args.config == "plain":
        result = measure_plain(workload, args.warmup, args.steps)
    else:
        result = measure_strategy(args.config, workload, args.replicas, args.warmup, args.steps)
    json.dump(asdict(result), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
