"""The in-process configurations of `real_models.py` measured interleaved: plain PyTorch, OneDevice,
Mirrored x2 and CentralStorage x2 (both with exact BatchNorm, and Mirrored x2 also with per-replica
statistics on ResNet-18) train the same model side by side in one process, in alternating blocks of a few
steps, so a disturbance from other work on a shared machine hits every configuration alike instead of the
one that happened to be running.

    .venv/bin/python benchmarks/in_process.py                                  # 3 models, 8 blocks of 3 steps
    .venv/bin/python benchmarks/in_process.py --models resnet18 --blocks 10 --steps 4

Every configuration starts from the same parameters and trains on the same seeded global batches
(`stratagem.bench.real_models`); each keeps its own model and optimizer across its blocks. Plain PyTorch
and OneDevice use all of torch's intra-op threads; the strategies give each replica its share, as they do
for a user. Prints each configuration's median ms per step and the median (range) of its per-block ratio
to plain PyTorch's samples/s, the figure issue 29's goals are stated in.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

MODEL_NAMES = ("resnet18", "gpt2", "bert")


def configurations(spec: Any, batches: list[Any]) -> dict[str, Callable[[], Callable[[int], Any]]]:
    """Name -> a builder of its step on global batch i (called once; each step trains its own model)."""
    import stratagem as sg
    from stratagem.bench import real_models as rm
    from stratagem.bench.zoo import make_step
    from stratagem.devices import DeviceRegistry

    def plain() -> Callable[[int], Any]:
        net = rm.build_model(spec)
        optimizer = rm.build_optimizer(spec, net)
        net.train()
        step = make_step(spec.name, net, optimizer, rm.build_scheduler(spec, optimizer, 10_000))
        return lambda i: step(batches[i])

    def strategy(make: Callable[[Any, list[str]], Any]) -> Callable[[], Callable[[int], Any]]:
        def build() -> Callable[[int], Any]:
            registry = DeviceRegistry()
            registry.set_logical_device_configuration("cpu", 2)
            s = make(registry, ["cpu:0", "cpu:1"])
            net = rm.build_model(spec)
            model, optimizer = s.distribute(net, rm.build_optimizer(spec, net))
            scheduler = rm.build_scheduler(spec, optimizer, 10_000)
            step = make_step(
                spec.name, model, optimizer, None if scheduler is None else s.distribute_scheduler(scheduler)
            )
            model.train()
            distributed = list(s.distribute_dataset(batches))
            return lambda i: s.run(step, args=(distributed[i],))

        return build

    built: dict[str, Callable[[], Callable[[int], Any]]] = {
        "plain": plain,
        "one_device": strategy(lambda registry, devices: sg.OneDeviceStrategy("cpu")),
        "mirrored": strategy(lambda registry, devices: sg.MirroredStrategy(devices, registry=registry)),
        "central_storage": strategy(lambda registry, devices: sg.CentralStorageStrategy(devices, registry=registry)),
    }
    if spec.name == "resnet18":
        built["mirrored_per_replica_bn"] = strategy(
            lambda registry, devices: sg.MirroredStrategy(devices, registry=registry, batch_norm="per_replica")
        )
    return built


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODEL_NAMES))
    parser.add_argument("--blocks", type=int, default=8, help="blocks per configuration, alternating")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per block (after one untimed step)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 blocks of 1 step: checks the harness")
    args = parser.parse_args()
    models = [m.strip() for m in args.models.split(",")]
    if any(m not in MODEL_NAMES for m in models):
        parser.error(f"unknown model in {models}; choose from {MODEL_NAMES}")
    import os

    import torch

    from stratagem.bench import real_models as rm

    if args.quick:
        args.blocks, args.steps = 2, 1
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} intra-op threads, load {os.getloadavg()[0]:.1f}", flush=True)
    for model in models:
        spec = (rm.MODELS_QUICK if args.quick else rm.MODELS)[model]
        batches = rm.make_batches(spec, 4)
        built = {name: build() for name, build in configurations(spec, batches).items()}
        times: dict[str, list[float]] = {name: [] for name in built}
        for block in range(args.blocks):
            order = list(built) if block % 2 == 0 else list(built)[::-1]
            for name in order:
                step = built[name]
                step(block % len(batches))  # untimed: the block's first step after another configuration
                start = time.perf_counter()
                for i in range(args.steps):
                    step((block + i) % len(batches))
                times[name].append((time.perf_counter() - start) / args.steps)
        print(f"\n{spec.describe()}; {args.blocks} blocks of {args.steps} steps, load {os.getloadavg()[0]:.1f}")
        for name, per_block in times.items():
            ratios = [p / t for p, t in zip(times["plain"], per_block)]
            print(
                f"  {name:24s} {statistics.median(per_block) * 1e3:7.1f} ms/step   / plain samples/s: "
                f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})",
                flush=True,
            )
        if "mirrored_per_replica_bn" in times:
            exact = [p / g for p, g in zip(times["mirrored_per_replica_bn"], times["mirrored"])]
            print(
                f"  Mirrored x2 exact / per-replica BatchNorm, step time: {1 / statistics.median(exact):.3f} "
                f"(blocks {min(1 / r for r in exact):.3f}-{max(1 / r for r in exact):.3f})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
