"""Issue 25's benchmark: ShardedStrategy (stage 2 and 3) against MultiWorkerMirroredStrategy, 2 processes on
this host, on the 12.6M-parameter MLP with AdamW: samples/s and peak RSS per rank.

    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python benchmarks/sharded.py             # 5 warm-up + 20 steps
    .venv/bin/python benchmarks/sharded.py --steps 50 --strategies sharded2 multi_worker

Each strategy runs as `stratagem launch --workers 2` would start it (the same launcher, in turn); each rank
prints one JSON line with its samples/s over the timed steps and its peak resident set (ru_maxrss). With
glibc's default settings freed blocks of a few MiB stay in the heap, which hides what sharding saves;
MALLOC_MMAP_THRESHOLD_=65536 returns them (see docs/sharded.md).

Speed, side by side (`--speed ROUNDS`): the MLP (AdamW), the reference CNN (stratagem.bench.workloads, SGD) and a
tiny GPT-2 (4 blocks of width 128, AdamW) under stage 2 and MultiWorkerMirroredStrategy, in the same two processes
started by `stratagem launch`: each round builds each strategy in turn (the order alternating between rounds), runs
the warm-up steps, times the steps between two reductions and closes it; the ratio of each round compares blocks
run a few seconds apart, so a disturbance from other work on a shared machine hits both sides alike.

    .venv/bin/python benchmarks/sharded.py --speed 5 --steps 10 --warmup 3
    .venv/bin/python benchmarks/sharded.py --speed 5 --models mlp --strategies sharded2 sharded3 multi_worker
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

STRATEGIES = (
    "sharded2", "sharded3", "multi_worker", "sharded2_gloo", "sharded2_reuse", "sharded2_gloo_reuse",
    "sharded2_blocks", "sharded2_blocks_reuse", "sharded2_gloo_blocks_reuse", "multi_worker_gloo",
)  # fmt: skip
"""sharded2_gloo: stage 2 with its all-gathers and reduce-scatters through Gloo (shared_memory=False); _reuse: with
host_memory="reuse" (freed host memory kept for the next step once the optimizer's state exists); _blocks: a unit per
block, given as `units=` (the model's Linear, Conv2d or GPT2Block), where stage 2's default merges blocks of up to
8 MiB into one unit (`sharded/units.py`). multi_worker_gloo: MultiWorkerMirroredStrategy with its sums through Gloo
(shared_memory=False), the baseline of the _gloo ones when it runs beside them."""


def baseline(name: str, names: list[str]) -> str | None:
    """What `name` is compared with: MultiWorkerMirrored on the same transport where it runs, else the default."""
    if name.startswith("multi_worker"):
        return None
    if "gloo" in name and "multi_worker_gloo" in names:
        return "multi_worker_gloo"
    return "multi_worker" if "multi_worker" in names else None


def sharded_options(name: str, model: str = "mlp") -> dict[str, Any]:
    """The ShardedStrategy arguments a strategy name of STRATEGIES stands for, on the model of that name."""
    options: dict[str, Any] = {
        "stage": int(name[7]),
        "shared_memory": False if "gloo" in name else None,
        "host_memory": "reuse" if name.endswith("reuse") else "release",
    }
    if "blocks" in name:
        options["units"] = block_classes(model)
    return options


def block_classes(model: str) -> tuple[type, ...]:
    """The classes of the blocks of each model: the default's units before stage 2 merged them."""
    if model == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return (GPT2Block,)
    return (nn.Conv2d, nn.Linear) if model == "cnn" else (nn.Linear,)


MODELS = ("mlp", "cnn", "gpt2")


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

    if name.startswith("multi_worker"):
        strategy: sg.Strategy = sg.MultiWorkerMirroredStrategy(shared_memory=False if "gloo" in name else None)
    else:
        strategy = sg.ShardedStrategy(**sharded_options(name))
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


def speed_workload(
    name: str, batch: int, foreach: bool | None = None
) -> tuple[nn.Module, Callable[[Any], torch.optim.Optimizer], list[Any]]:
    """The model, its optimizer (`foreach` passed to it) and 4 global batches of `name` (the step's loss is the model's
    output's)."""
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        data = [(torch.randn(batch, 1024, generator=g), torch.randn(batch, 1024, generator=g)) for _ in range(4)]
        return mlp(), lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=foreach), data
    if name == "cnn":
        from stratagem.bench.workloads import WORKLOADS

        workload = WORKLOADS["cnn"]
        sgd = lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, foreach=foreach)  # noqa: E731
        return workload.build_model(), sgd, workload.make_batches()[:4]
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=2048, n_positions=64, n_embd=128, n_layer=4, n_head=4)
    ids = [torch.randint(0, 2048, (16, 64), generator=g) for _ in range(4)]
    return GPT2LMHeadModel(config), lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=foreach), [(i, i) for i in ids]


def speed_worker(args: argparse.Namespace) -> None:
    """One rank of --speed: every round, every model under each strategy in turn (clusters on the given ports)."""
    import stratagem as sg

    rank = int(json.loads(os.environ["TF_CONFIG"])["task"]["index"]) if "TF_CONFIG" in os.environ else 0
    ports = iter(args.ports)
    rows = []
    for round_ in range(args.speed):
        for model_name in args.models:
            order = args.strategies if round_ % 2 == 0 else args.strategies[::-1]
            for name in order:
                pair = [next(ports), next(ports)]
                cluster = {
                    "cluster": {"worker": [f"127.0.0.1:{p}" for p in pair]},
                    "task": {"type": "worker", "index": rank},
                }
                if name.startswith("multi_worker"):
                    gloo = False if "gloo" in name else None
                    strategy: sg.Strategy = sg.MultiWorkerMirroredStrategy(cluster=cluster, shared_memory=gloo)
                else:
                    strategy = sg.ShardedStrategy(cluster=cluster, **sharded_options(name, model_name))
                net, make_optimizer, data = speed_workload(model_name, args.batch, args.foreach or None)
                model, optimizer = strategy.distribute(net, make_optimizer(net.parameters()))
                del net

                def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                    if model_name == "gpt2":
                        loss = model(input_ids=x, labels=y).loss
                    elif model_name == "cnn":
                        loss = nn.functional.cross_entropy(model(x), y)
                    else:
                        loss = ((model(x) - y) ** 2).mean()
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    return loss.detach()

                total = args.steps + args.warmup
                batches = list(strategy.distribute_dataset(data * (total // len(data) + 1)))[:total]
                for x, y in batches[: args.warmup]:
                    strategy.run(step, args=(x, y))
                strategy.reduce("sum", torch.ones(()))  # every rank starts the clock together
                start, cpu = time.perf_counter(), time.process_time()
                for x, y in batches[args.warmup :]:
                    strategy.run(step, args=(x, y))
                cpu = time.process_time() - cpu  # every thread of this process, Gloo's included
                strategy.reduce("sum", torch.ones(()))
                elapsed = time.perf_counter() - start
                # On a machine shared with other work the clock measures this job's share of the cores as much
                # as its cost; the CPU seconds both ranks spent per step measure the cost alone.
                cpu_both = float(strategy.reduce("sum", torch.tensor(cpu, dtype=torch.float64)))
                global_batch = int(data[0][0].shape[0])
                paths = ("all-gather and reduce-scatter", "cross-worker sums")
                decisions = strategy.explain().decisions
                transport = [f"{d.subject}: {d.choice}" for d in decisions if d.subject in paths]
                units = [d.choice for d in decisions if d.subject == "sharding units"]
                rows.append(
                    {
                        "round": round_,
                        "model": model_name,
                        "strategy": name,
                        "samples_per_s": args.steps * global_batch / elapsed,
                        "cpu_ms_per_step": 1e3 * cpu_both / args.steps,
                        "load": os.getloadavg()[0],
                        "transport": transport,
                        "units": units,
                    }
                )
                strategy.close()
    if rank == 0:
        print("speed rows:", json.dumps(rows), flush=True)


def speed(args: argparse.Namespace) -> None:
    """--speed: launches the two ranks once, then prints per model each strategy's samples/s and stage 2's ratio."""
    from stratagem import environ
    from stratagem.cluster import launch
    from stratagem.cluster.launch import free_ports

    count = 2 * args.speed * len(args.models) * len(args.strategies)
    command = [sys.executable, __file__, "--speed-worker", "--speed", str(args.speed), "--steps", str(args.steps)]
    command += ["--warmup", str(args.warmup), "--batch", str(args.batch), "--models", *args.models]
    command += ["--strategies", *args.strategies, "--ports", *map(str, free_ports(count))]
    command += ["--foreach"] if args.foreach else []
    lines: list[str] = []
    before = os.getloadavg()
    result = launch(
        command, workers=2, env=dict(environ.current()), sink=lambda line: lines.append(line.text), timeout=3000
    )
    after = os.getloadavg()
    rows = [row for t in lines if t.startswith("speed rows: ") for row in json.loads(t.removeprefix("speed rows: "))]
    if result.exit_code != 0 or not rows:
        print(f"exit code {result.exit_code}", *lines[-30:], sep="\n")
        raise SystemExit(1)
    print(
        f"load average (1, 5, 15 min) before {before[0]:.1f}, {before[1]:.1f}, {before[2]:.1f}; "
        f"after {after[0]:.1f}, {after[1]:.1f}, {after[2]:.1f}"
    )
    print(
        "| model | strategy | samples/s (median; range) | against | / it (median; range over rounds) "
        "| CPU ms per step, both ranks (median) | / it (median; range) |"
    )
    print("|---|---|---|---|---|---|---|")
    for model_name in args.models:
        by = {n: [r for r in rows if r["model"] == model_name and r["strategy"] == n] for n in args.strategies}
        for name in args.strategies:
            rates = [r["samples_per_s"] for r in by[name]]
            cell = f"{statistics.median(rates):.1f}; {min(rates):.1f}-{max(rates):.1f}"
            cpu = statistics.median(r["cpu_ms_per_step"] for r in by[name])
            ratio = cpu_ratio = ""
            against = baseline(name, args.strategies)
            if against is not None:
                ratios = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(by[name], by[against])]
                ratio = f"{statistics.median(ratios):.2f}x; {min(ratios):.2f}-{max(ratios):.2f}x"
                cpus = [a["cpu_ms_per_step"] / b["cpu_ms_per_step"] for a, b in zip(by[name], by[against])]
                cpu_ratio = f"{statistics.median(cpus):.2f}x; {min(cpus):.2f}-{max(cpus):.2f}x"
            print(f"| {model_name} | {name} | {cell} | {against or ''} | {ratio} | {cpu:.0f} | {cpu_ratio} |")
    transports = {t for r in rows for t in r["transport"]}
    print(*sorted(transports), sep="\n")
    units = {(r["model"], r["strategy"]): r["units"] for r in rows if r["units"]}
    print(*(f"{m}, {n}: sharding units: {u[0]}" for (m, n), u in sorted(units.items())), sep="\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "load_before": before, "load_after": after}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64, help="the global batch")
    parser.add_argument("--speed", type=int, default=0, metavar="ROUNDS", help="speed side by side, ROUNDS rounds")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS, help="--speed's models")
    parser.add_argument("--json", help="--speed: also write every block's figures to this file")
    parser.add_argument(
        "--foreach", action="store_true", help="--speed: every optimizer with foreach=True (one op per list of shards)"
    )
    parser.add_argument("--worker", choices=STRATEGIES, help=argparse.SUPPRESS)
    parser.add_argument("--speed-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ports", nargs="+", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.speed_worker:
        speed_worker(args)
        return
    if args.speed:
        if "--strategies" not in sys.argv:
            args.strategies = ["sharded2", "multi_worker"]
        speed(args)
        return
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
