"""Issue 40's memory benchmark: each rank's peak RSS under TensorParallelStrategy over its RSS before the model,
against the rank's `memory_plan()`.

    PYTHONPATH=src .venv/bin/python benchmarks/tensor_parallel_memory.py                  # MLP and GPT-2, tp2 tp2x2
    PYTHONPATH=src .venv/bin/python benchmarks/tensor_parallel_memory.py --models gpt2 --configs tp2 --no-activations

Each configuration runs as `stratagem launch --workers N` starts it: tp2 is a mesh of one `model` axis over 2
workers, tp2x2 a (data 2, model 2) mesh over 4, tp2x2z3 the same with every weight's dimension that `model` leaves whole sharded
along `data` too (ZeRO-3). The models, float32 with AdamW, 3 steps:

- mlp: 8 x Linear(2048, 2048) (33.6M parameters, 128 MiB), Megatron's pairs: the even layers split along their output
  features (weight and bias), the odd ones along their input features (bias whole); global batch 64;
- gpt2: transformers' GPT2LMHeadModel (vocabulary 8192, 512 features, 6 layers, 8 heads, eager attention, 128
  positions, no dropout: 23.2M parameters, 88 MiB), split as docs/tensor_parallel.md splits it; global batch
  16 x 128 tokens, the model's own loss.

The figure is VmHWM minus the RSS just before the model was built, per rank: after transformers' code, and after a
tiny split model trained one step on the same mesh and closed (`warm_up`: DTensor's code and caches, 70 MiB of the
resident set at their first use, are the library's, not the model's), then the measured strategy built. The plan
counts the step's activations measured by `memory_plan(example_inputs=...)` (one forward and backward of the split
model, run by every worker after `distribute`; `--no-activations`: the plan without them). `--profile`: RSS, peak
and the bytes of every live storage at points of the run. Memory figures hold under CPU load; no time is reported.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from typing import Any

import torch
from torch import nn

CONFIGS = {"tp2": ((2,), ("model",)), "tp2x2": ((2, 2), ("data", "model")), "tp2x2z3": ((2, 2), ("data", "model"))}
ZERO3 = {"tp2x2z3"}  # the weights also sharded along `data` (ZeRO-3, tensor_parallel/data_sharding.py)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)])


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # Eager attention: DTensor runs its ops; sdpa's fused kernel is refused (docs/tensor_parallel.md). No dropout:
    # DTensor cannot draw dropout's mask on a partial sum (attention's c_proj output); the tests' GPT-2 has none.
    config = GPT2Config(
        vocab_size=8192, n_positions=128, n_embd=512, n_layer=6, n_head=8, attn_implementation="eager",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def layout_map(model: str, mesh: Any, zero3: bool = False) -> Any:
    """`zero3`: every weight's dimension that `model` leaves whole split along `data` too."""
    import stratagem as sg

    data = "data" if zero3 else None
    layouts = sg.LayoutMap(mesh)
    if model == "mlp":
        for i in range(0, 8, 2):
            layouts[rf"^{i}\.weight"] = ("model", data)  # Linear is (out, in): output features
            layouts[rf"^{i}\.bias"] = ("model",)
            layouts[rf"^{i + 1}\.weight"] = (data, "model")  # input features: partial sums, all-reduced
        return layouts
    layouts[r"wte\.weight"] = ("model", data)
    layouts[r"attn\.c_attn\.weight"] = (data, "model")
    layouts[r"attn\.c_attn\.bias"] = ("model",)
    layouts[r"attn\.c_proj\.weight"] = ("model", data)
    layouts[r"mlp\.c_fc\.weight"] = (data, "model")
    layouts[r"mlp\.c_fc\.bias"] = ("model",)
    layouts[r"mlp\.c_proj\.weight"] = ("model", data)
    return layouts


def warm_up(shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    """DTensor's code and caches (sharding propagation, the collectives' first use), loaded before the baseline by
    a step of a tiny split model on the same mesh, closed before the measured strategy is built: they are the
    library's memory, not the model's."""
    import stratagem as sg

    tiny = sg.TensorParallelStrategy(layout_map("mlp", sg.DeviceMesh(shape, names)), check_batches=False)
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])
    model, optimizer = tiny.distribute(net, torch.optim.AdamW(net.parameters()))

    def step(x: torch.Tensor) -> None:
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    for (x,) in tiny.distribute_dataset([(torch.randn(4, 4),)]):
        tiny.run(step, args=(x,))
    tiny.close()


def status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def worker(args: argparse.Namespace) -> None:
    import stratagem as sg

    shape, names = CONFIGS[args.config]
    warm_up(shape, names)
    strategy = sg.TensorParallelStrategy(layout_map(args.model, sg.DeviceMesh(shape, names), args.config in ZERO3))
    if args.model == "gpt2":  # transformers' code (a few hundred MiB once imported) is not the model's memory
        import transformers.models.gpt2.modeling_gpt2  # noqa: F401
    gc.collect()
    baseline = status("VmRSS")
    points: list[tuple[str, int, int, int]] = []

    def mark(what: str) -> None:
        if args.profile:
            from sharded_memory import live_storage_bytes  # benchmarks/: every storage a Python object refers to

            points.append((what, status("VmRSS") - baseline, status("VmHWM") - baseline, live_storage_bytes()))

    net = mlp() if args.model == "mlp" else gpt2()
    mark("the user's model built")
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    if args.model == "mlp":
        data: list[Any] = [(torch.randn(64, 2048, generator=g), torch.randn(64, 2048, generator=g)) for _ in range(3)]
        example: Any = (data[0][0],)
    else:
        data = [(i, i) for i in (torch.randint(0, 8192, (16, 128), generator=g) for _ in range(3))]
        example = {"input_ids": data[0][0], "labels": data[0][1]}
    before = strategy.memory_plan(net, optimizer)
    model, optimizer = strategy.distribute(net, optimizer)
    mark("after distribute")
    del net
    gc.collect()
    mark("after del net")
    plan = before if args.no_activations else strategy.memory_plan(example_inputs=example)
    mark("after measuring activations")
    after_measuring = status("VmHWM") - baseline

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if args.model == "mlp":
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
        "rank": strategy.worker_group.rank,
        "peak_over_baseline": status("VmHWM") - baseline,
        "peak_after_measuring": after_measuring,
        "baseline": baseline,
        "plan_total": plan.total,
        "plan": plan.to_dict(),
        "points": points,
    }
    print("MEMORY " + json.dumps(line), flush=True)
    strategy.close()


def run_config(config: str, model: str, *, no_activations: bool, profile: bool) -> list[dict[str, Any]]:
    from stratagem import environ
    from stratagem.cluster import launch

    shape, _ = CONFIGS[config]
    workers = 1
    for n in shape:
        workers *= n
    command = [sys.executable, __file__, "--worker", "--configs", config, "--models", model]
    command += ["--no-activations"] if no_activations else []
    command += ["--profile"] if profile else []
    lines: list[str] = []
    env = dict(environ.current())
    result = launch(command, workers=workers, env=env, sink=lambda line: lines.append(line.text), timeout=900)
    rows = [json.loads(t.split("MEMORY ", 1)[1]) for t in lines if "MEMORY " in t]
    if result.exit_code != 0 or len(rows) != workers:
        print(f"{config} {model}: exit code {result.exit_code}", *lines[-30:], sep="\n")
        return []
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt2"], choices=["mlp", "gpt2"])
    parser.add_argument("--no-activations", action="store_true", help="the plan without example_inputs")
    parser.add_argument("--profile", action="store_true", help="RSS and peak at points of the run, per rank")
    parser.add_argument("--json", help="also write every rank's figures to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.config, args.model = args.configs[0], args.models[0]
        worker(args)
        return
    mib = 2**20
    everything = []
    print(
        "| model | mesh | peak over baseline, per rank (MiB) | plan, per rank (MiB) | measured / plan, per rank "
        "| of which activations planned (MiB) | whole model (MiB) |"
    )
    print("|---|---|---|---|---|---|---|")
    for model in args.models:
        for config in args.configs:
            rows = run_config(config, model, no_activations=args.no_activations, profile=args.profile)
            if not rows:
                continue
            everything.extend(rows)
            peaks = ", ".join(f"{r['peak_over_baseline'] / mib:.0f}" for r in rows)
            plans = ", ".join(f"{r['plan_total'] / mib:.0f}" if r["plan_total"] else "?" for r in rows)
            ratios = ", ".join(
                f"{r['peak_over_baseline'] / r['plan_total']:.2f}" if r["plan_total"] else "?" for r in rows
            )
            activations = ", ".join(f"{r['plan']['activations'] / mib:.0f}" for r in rows)
            whole = rows[0]["plan"]["whole_model"] / mib
            print(f"| {model} | {config} | {peaks} | {plans} | {ratios} | {activations} | {whole:.0f} |", flush=True)
            for r in rows if args.profile else []:
                print(
                    f"  rank {r['rank']} (baseline {r['baseline'] / mib:.0f} MiB): point, RSS, peak (MiB over "
                    "baseline), live storage (MiB)"
                )
                for what, rss, hwm, live in r["points"]:
                    print(f"    {what:30s} {rss / mib:8.0f} {hwm / mib:8.0f} {live / mib:8.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)


if __name__ == "__main__":
    main()
