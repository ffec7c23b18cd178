"""Issue 25's benchmark: ShardedStrategy (stage 2 and 3) against MultiWorkerMirroredStrategy, 2 processes on
this host, on the 12.6M-parameter MLP with AdamW: samples/s and peak RSS per rank.

    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python benchmarks/sharded.py             # 5 warm-up + 20 steps
    .venv/bin/python benchmarks/sharded.py --steps 50 --strategies sharded2 multi_worker

Each strategy runs as `stratagem launch --workers 2` would start it (the same launcher, in turn); each rank
prints one JSON line with its samples/s over the timed steps and its peak resident set (ru_maxrss). With
glibc's default settings freed blocks of a few MiB stay in the heap, which hides what sharding saves;
MALLOC_MMAP_THRESHOLD_=65536 returns them (see docs/sharded.md).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch
from torch import nn

STRATEGIES = ("sharded2", "sharded3", "multi_worker")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    # 1024*2048 + 2*2048*2048 + 2048*1024 weights: 12.6M parameters, 50 MiB in float32.
    return nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
        nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 1024),
    )  # fmt: skip


def resident_mib() -> float:
    """This process's resident set now, in MiB (Linux's /proc/self/statm)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(name: str, steps: int, warmup: int, batch: int) -> None:
    import stratagem as sg

    if name == "multi_worker":
        strategy: sg.Strategy = sg.MultiWorkerMirroredStrategy()
    else:
        strategy = sg.ShardedStrategy(stage=int(name[-1]))
    # What every process holds before the model exists (the interpreter, torch, the process group, and FSDP2's
    # and DTensor's code, 44 MiB of RSS when imported, for every strategy alike): not what a strategy can save,
    # so the peak is also reported above it.
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    baseline = resident_mib()
    net = mlp()
    model, optimizer = strategy.distribute(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
    del net
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the peak so far: building and sharding
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(batch, 1024, generator=g), torch.randn(batch, 1024, generator=g)) for _ in range(4)]

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    batches = list(strategy.distribute_dataset(data * ((steps + warmup) // len(data) + 1)))[: steps + warmup]
    for x, y in batches[:warmup]:
        strategy.run(step, args=(x, y))
    strategy.reduce("sum", torch.ones(()))  # every rank starts the clock together
    start = time.perf_counter()
    for x, y in batches[warmup:]:
        strategy.run(step, args=(x, y))
    strategy.reduce("sum", torch.ones(()))
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    plan = strategy.memory_plan() if isinstance(strategy, sg.ShardedStrategy) else None
    line = {
        "strategy": name,
        "samples_per_s": steps * batch / elapsed,
        "peak_rss_mib": peak,
        "baseline_rss_mib": baseline,
        "peak_when_built_mib": built,
    }
    if plan is not None:
        line["planned_state_mib"] = (plan.parameters + plan.gradients + (plan.optimizer_state or 0)) / 2**20
        line["planned_peak_mib"] = (plan.total or 0) / 2**20
    print(json.dumps(line), flush=True)
    strategy.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64, help="the global batch")
    parser.add_argument("--worker", choices=STRATEGIES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.batch)
        return
    from stratagem import environ
    from stratagem.cluster import launch

    for name in args.strategies:
        lines: list[str] = []
        command = [sys.executable, __file__, "--worker", name, "--steps", str(args.steps)]
        command += ["--warmup", str(args.warmup), "--batch", str(args.batch)]
        result = launch(
            command, workers=2, env=dict(environ.current()), sink=lambda line: lines.append(line.text), timeout=900
        )
        rows = [json.loads(t) for t in lines if t.startswith("{")]
        if result.exit_code != 0 or len(rows) != 2:
            print(f"{name}: exit code {result.exit_code}", *lines[-20:], sep="\n")
            continue
        rate = sum(r["samples_per_s"] for r in rows) / 2
        peaks = ", ".join(f"{r['peak_rss_mib']:.0f}" for r in rows)
        above = ", ".join(f"{r['peak_rss_mib'] - r['baseline_rss_mib']:.0f}" for r in rows)
        above += "; " + ", ".join(f"{r['peak_when_built_mib'] - r['baseline_rss_mib']:.0f}" for r in rows)
        planned = ""
        if "planned_state_mib" in rows[0]:
            planned = (
                f", planned state {rows[0]['planned_state_mib']:.1f} MiB, peak {rows[0]['planned_peak_mib']:.1f} MiB"
            )
        print(
            f"{name}: {rate:.1f} samples/s, peak RSS per rank {peaks} MiB ({above} above the baseline; of it before the first step){planned}"
        )


if __name__ == "__main__":
    main()
