"""Issue 39's memory benchmark: each rank's peak RSS over its RSS before the model, ShardedStrategy (stage 2 and 3)
against MultiWorkerMirroredStrategy, the memory plan beside it, and a profile of where the memory goes.

    PYTHONPATH=src .venv/bin/python benchmarks/sharded_memory.py                       # the table, MLP
    PYTHONPATH=src .venv/bin/python benchmarks/sharded_memory.py --models mlp gpt2 --configs s3x2 s2x2 s3x3 mw2
    PYTHONPATH=src .venv/bin/python benchmarks/sharded_memory.py --profile --configs s3x2   # RSS and storages at points
    PYTHONPATH=src .venv/bin/python benchmarks/sharded_memory.py --models gpt2_narrow --configs mw2 s2x2 s2x2b s3x2

Each configuration runs as `stratagem launch --workers N` starts it (the launcher's allocator settings included,
`--default-allocator` to leave glibc's), on a 50.3M-parameter MLP (12 x Linear(2048, 2048)) or a tiny GPT-2,
AdamW, float32, global batch 64, 3 steps. The figure is VmHWM minus the RSS just before the model was built (after
the strategy, its process group and FSDP2's code), the larger rank; `STRATAGEM_SHARED_MEMORY=0` (`--gloo`) sends
the units' collectives through Gloo. The sharded plan counts the step's activations, measured by
`memory_plan(net, optimizer, example_inputs=...)` on fake tensors (`--no-activations`: without them). Memory figures
hold under CPU load; no time is reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
from typing import Any

import torch
from torch import nn

CONFIGS = {"s3x2": ("sharded", 3, 2), "s2x2": ("sharded", 2, 2), "s3x3": ("sharded", 3, 3), "s2x3": ("sharded", 2, 3),
           "mw2": ("multi_worker", 0, 2), "mw3": ("multi_worker", 0, 3),
           "s2x2r": ("sharded", 2, 2), "s2x3r": ("sharded", 2, 3), "s2x2b": ("sharded", 2, 2)}  # fmt: skip
"""s...r: host_memory="reuse" (freed host memory kept for the next step once the optimizer's state exists); s...b: a unit
per block (units=(Linear,) or (GPT2Block,)) where stage 2's default merges blocks into units of up to 8 MiB."""
MODELS = ("mlp", "gpt2", "gpt2_narrow", "mlp_narrow")
"""gpt2_narrow: 12 blocks of width 256 (3.0 MiB each), which stage 2's default merges two to a unit; mlp_narrow:
48 x Linear(512, 512) (1.0 MiB each), merged seven to a unit (small activations: the units' bytes show)."""


def mlp(narrow: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if narrow:
        return nn.Sequential(*[nn.Linear(512, 512) for _ in range(48)])  # 12.6M parameters, 48 MiB in float32
    return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(12)])  # 50.3M parameters, 192 MiB in float32


def gpt2(narrow: bool = False) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    width, layers = (256, 12) if narrow else (512, 6)
    return GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_positions=128, n_embd=width, n_layer=layers, n_head=8))


def status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def live_storage_bytes() -> int:
    """Bytes of every distinct CPU storage a Python object refers to (tensors, DTensors' local parts)."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if type(obj) is not torch.Tensor and not isinstance(obj, torch.Tensor):
                continue
            t = obj.to_local() if hasattr(obj, "to_local") else obj
            if t.device.type != "cpu" or t.is_meta:
                continue
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        except Exception:  # a tensor subclass or wrapper without storage
            continue
    return sum(seen.values())


def worker(args: argparse.Namespace) -> None:
    import stratagem as sg

    kind, stage, _ = CONFIGS[args.config]
    if kind == "multi_worker":
        strategy: Any = sg.MultiWorkerMirroredStrategy()
    else:
        units: Any = (nn.Linear,) if args.config.endswith("b") else None
        if units and args.model.startswith("gpt2"):
            from transformers.models.gpt2.modeling_gpt2 import GPT2Block

            units = (GPT2Block,)
        host_memory = "reuse" if args.config.endswith("r") else "release"
        strategy = sg.ShardedStrategy(stage=stage, units=units, host_memory=host_memory)
    import torch.distributed.fsdp  # noqa: F401  (FSDP2's and DTensor's code, imported before the baseline)
    import torch.distributed.tensor  # noqa: F401

    if args.model.startswith("gpt2"):  # transformers' code (a few hundred MiB once imported) is not the model's memory
        import transformers.models.gpt2.modeling_gpt2  # noqa: F401
    gc.collect()
    baseline = status("VmRSS")
    points: list[tuple[str, int, int, int]] = []

    def mark(what: str) -> None:
        if args.profile:
            points.append((what, status("VmRSS") - baseline, status("VmHWM") - baseline, live_storage_bytes()))

    if args.model.startswith("mlp"):
        net = mlp(narrow=args.model == "mlp_narrow")
    else:
        net = gpt2(narrow=args.model == "gpt2_narrow")
    mark("the user's model built")
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    if args.model.startswith("mlp"):
        width = 512 if args.model == "mlp_narrow" else 2048
        data = [(torch.randn(64, width, generator=g), torch.randn(64, width, generator=g)) for _ in range(args.steps)]
        example: Any = data[0][0]
    else:
        data = [(i, i) for i in (torch.randint(0, 8192, (16, 128), generator=g) for _ in range(args.steps))]
        example = {"input_ids": data[0][0], "labels": data[0][1]}
    if kind == "sharded" and not args.no_activations:  # one forward and backward on fake tensors, this rank's part
        plan = strategy.memory_plan(net, optimizer, example_inputs=example)
    else:
        plan = strategy.memory_plan(net, optimizer) if hasattr(strategy, "memory_plan") else None
    model, optimizer = strategy.distribute(net, optimizer)
    mark("after distribute")
    del net
    gc.collect()
    mark("after del net")

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if args.model.startswith("mlp"):
            loss = ((model(x) - y) ** 2).mean()
        else:
            loss = model(input_ids=x, labels=y).loss
        mark("  forward")
        loss.backward()
        mark("  backward")
        optimizer.step()
        mark("  optimizer step")
        optimizer.zero_grad()
        return loss.detach()

    for i, (x, y) in enumerate(strategy.distribute_dataset(data)):
        strategy.run(step, args=(x, y))
        mark(f"after step {i + 1}")
    line = {
        "config": args.config,
        "model": args.model,
        "rank": strategy.cluster.task_index if hasattr(strategy.cluster, "task_index") else -1,
        "peak_over_baseline": status("VmHWM") - baseline,
        "baseline": baseline,
        "plan_total": None if plan is None else plan.total,
        "plan": None if plan is None else {**dataclasses.asdict(plan), "total": plan.total},
        "points": points,
    }
    print("MEMORY " + json.dumps(line), flush=True)
    strategy.close()


def run_config(
    config: str,
    model: str,
    *,
    gloo: bool,
    default_allocator: bool,
    profile: bool,
    no_activations: bool = False,
    steps: int = 3,
) -> list[dict[str, Any]]:
    from stratagem import environ
    from stratagem.cluster import launch

    kind, _, workers = CONFIGS[config]
    env = dict(environ.current())
    if gloo:
        env["STRATAGEM_SHARED_MEMORY"] = "0"
    command = [sys.executable, __file__, "--worker", "--configs", config, "--models", model]
    command += ["--profile"] if profile else []
    command += ["--steps", str(steps)]
    command += ["--no-activations"] if no_activations else []
    lines: list[str] = []
    kwargs: dict[str, Any] = {"keep_freed_memory": False} if default_allocator else {}
    result = launch(command, workers=workers, env=env, sink=lambda line: lines.append(line.text), timeout=900, **kwargs)
    rows = [json.loads(t.split("MEMORY ", 1)[1]) for t in lines if "MEMORY " in t]
    if result.exit_code != 0 or len(rows) != workers:
        print(f"{config} {model}: exit code {result.exit_code}", *lines[-30:], sep="\n")
        return []
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["mw2", "s3x2", "s2x2", "mw3", "s3x3"], choices=list(CONFIGS))
    parser.add_argument("--models", nargs="+", default=["mlp"], choices=MODELS)
    parser.add_argument("--gloo", action="store_true", help="STRATAGEM_SHARED_MEMORY=0: collectives through Gloo")
    parser.add_argument("--default-allocator", action="store_true", help="glibc's malloc thresholds left as they are")
    parser.add_argument("--profile", action="store_true", help="RSS, peak and live storage at points, per rank")
    parser.add_argument("--no-activations", action="store_true", help="the sharded plan without example_inputs")
    parser.add_argument("--json", help="also write every rank's figures to this file")
    parser.add_argument("--steps", type=int, default=3, help="training steps (3: the issue's measure)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.config, args.model = args.configs[0], args.models[0]
        worker(args)
        return
    mib = 2**20
    everything = []
    print(
        "| model | configuration | peak over baseline, per rank (MiB) | larger | / MultiWorkerMirrored | plan (MiB) | measured / plan (each rank / its plan) |"
    )
    print("|---|---|---|---|---|---|---|")
    for model in args.models:
        reference: dict[int, int] = {}
        for config in args.configs:
            rows = run_config(
                config,
                model,
                gloo=args.gloo,
                default_allocator=args.default_allocator,
                profile=args.profile,
                no_activations=args.no_activations,
                steps=args.steps,
            )
            if not rows:
                continue
            everything.extend(rows)
            peak = max(r["peak_over_baseline"] for r in rows)
            workers = CONFIGS[config][2]
            if CONFIGS[config][0] == "multi_worker":
                reference[workers] = peak
            against = f"{peak / reference[2]:.2f}x" if 2 in reference else ""
            plans = [r["plan_total"] for r in rows if r["plan_total"]]
            plan = max(plans) if plans else None
            ratio = f"{peak / plan:.2f}" if plan else ""
            if plan and all(r["plan_total"] for r in rows):  # each rank against its own plan (its part of the batch)
                own = [r["peak_over_baseline"] / r["plan_total"] for r in rows]
                ratio += f" (ranks {min(own):.2f}-{max(own):.2f})"
            per_rank = ", ".join(f"{r['peak_over_baseline'] / mib:.0f}" for r in rows)
            print(f"| {model} | {config} | {per_rank} | {peak / mib:.0f} | {against} | "
                  f"{'' if plan is None else f'{plan / mib:.0f}'} | {ratio} |", flush=True)  # fmt: skip
            if args.profile:
                for r in rows:
                    print(
                        f"  rank (baseline {r['baseline'] / mib:.0f} MiB): point, RSS, peak, live storage (MiB over baseline / MiB)"
                    )
                    for what, rss, hwm, live in r["points"]:
                        print(f"    {what:28s} {rss / mib:8.0f} {hwm / mib:8.0f} {live / mib:8.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)


if __name__ == "__main__":
    main()
