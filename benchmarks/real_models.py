"""Issue 29's real-model benchmark: ResNet-18, a GPT-2 and a BERT classifier (built from configurations, nothing
downloaded; sizes in stratagem.bench.real_models) under plain PyTorch, OneDevice, Mirrored x2, CentralStorage
x2, MultiWorkerMirrored x2 (`stratagem launch --workers 2`), DDP x2 (`torchrun --nproc-per-node 2`, Gloo) and
accelerate x2 (`accelerate launch --multi_gpu --num_processes 2`, DDP over Gloo on a CPU) when accelerate is
installed.

    .venv/bin/python benchmarks/real_models.py                       # 3 models x 7 configurations, 3 rounds
    .venv/bin/python benchmarks/real_models.py --models gpt2 --repeats 2 --steps 6
    .venv/bin/python benchmarks/real_models.py --quick                # tiny shapes, 2 steps: checks the harness

Each configuration runs in its own processes (the two-process ones on free 127.0.0.1 ports), all with the
same allocator setting: GLIBC_TUNABLES as `stratagem launch` gives its tasks
(stratagem.cluster.allocator: freed memory kept for reuse), unless the environment already sets one, in
which case that one is used everywhere. Every configuration trains the same model from the same parameters
on the same seeded global batches, so the last step's loss must agree across configurations to float
rounding, except where BatchNorm differs (DDP and accelerate normalise with each process's half batch).

Rounds alternate the order of the configurations (reversed in odd rounds); each ratio is taken within one
round, and the table gives medians and ranges over the rounds. Peak RSS is each process's ru_maxrss (the
launchers' own processes not counted). The load average is read before every configuration.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MARKER = "real-models-result "
MODEL_NAMES = ("resnet18", "gpt2", "bert")  # the keys of stratagem.bench.real_models.MODELS
CONFIGS = ("plain", "one_device", "mirrored", "central_storage", "mwms", "ddp", "accelerate")
LABELS = {
    "plain": "plain PyTorch",
    "one_device": "OneDevice",
    "mirrored": "Mirrored x2",
    "central_storage": "CentralStorage x2",
    "mwms": "MultiWorkerMirrored x2",
    "ddp": "DDP x2 (torchrun)",
    "accelerate": "accelerate x2",
}
PROCESSES = {"mwms": 2, "ddp": 2, "accelerate": 2}
PER_REPLICA_BATCH_NORM = ("ddp", "accelerate")  # SyncBatchNorm has no CPU kernel
# Issue 29 item 4: (config, against, at least).
GOALS = (
    ("mirrored", "plain", 0.95),
    ("mwms", "ddp", 1.0),
    ("mwms", "accelerate", 1.0),
    ("central_storage", "plain", 0.9),
)


# ---- one configuration, inside its process -------------------------------------------------------------
def worker(config: str, model: str, warmup: int, steps: int, quick: bool, timeout: float) -> None:
    """Trains `model` under `config` in this process and prints one result line."""
    import torch

    import stratagem as sg
    from stratagem.bench import real_models as rm
    from stratagem.devices import DeviceRegistry

    spec = (rm.MODELS_QUICK if quick else rm.MODELS)[model]
    if config in PROCESSES:
        torch.set_num_threads(rm.cpu_threads_per_process(PROCESSES[config]))
    if config == "plain":
        result = rm.run_plain(spec, warmup, steps)
    elif config == "ddp":
        result = rm.run_ddp(spec, warmup, steps)
    elif config == "accelerate":
        result = rm.run_accelerate(spec, warmup, steps)
    elif config == "mwms":
        strategy = sg.MultiWorkerMirroredStrategy(["cpu:0"], timeout=timeout)  # the cluster from `stratagem launch`
        try:
            rank, world = strategy.cluster.rank or 0, strategy.cluster.world_size
            result = rm.run_strategy(config, strategy, spec, warmup, steps, rank=rank, world=world)
        finally:
            strategy.close()
    else:
        registry = DeviceRegistry()
        registry.set_logical_device_configuration("cpu", 2)
        devices = ["cpu:0", "cpu:1"]
        build = {
            "one_device": lambda: sg.OneDeviceStrategy("cpu"),
            "mirrored": lambda: sg.MirroredStrategy(devices, registry=registry, timeout=timeout),
            "central_storage": lambda: sg.CentralStorageStrategy(devices, registry=registry, timeout=timeout),
        }[config]
        strategy = build()
        try:
            result = rm.run_strategy(config, strategy, spec, warmup, steps)
        finally:
            strategy.close()
    print(MARKER + json.dumps(result.to_dict()), flush=True)


# ---- the driver ----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(config: str, model: str, args: argparse.Namespace) -> list[str]:
    """How a user starts `config`: the script itself, or its launcher with two processes."""
    script = [str(Path(__file__).resolve()), "--worker", config, "--model", model, "--warmup", str(args.warmup)]
    script += ["--steps", str(args.steps), "--timeout", str(args.timeout / 2)] + (["--quick"] if args.quick else [])
    py = sys.executable
    if config == "mwms":
        return [py, "-m", "stratagem", "launch", "--workers", "2", "--timeout", str(args.timeout), *script]
    if config == "ddp":
        return [
            py,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            *script,
        ]
    if config == "accelerate":
        return [
            py,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",  # torchrun's processes; the script's Accelerator(cpu=True) makes them one job on Gloo
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            str(free_port()),
            *script,
        ]
    return [py, *script]


def measure(config: str, model: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """Runs one configuration; its ranks' results (rank order), or the error that stopped it."""
    load = os.getloadavg()[0]
    try:
        proc = subprocess.run(
            command(config, model, args), capture_output=True, text=True, env=env, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"no result within --timeout {args.timeout:.0f} s", "load": load}
    ranks = [json.loads(line.split(MARKER, 1)[1]) for line in proc.stdout.splitlines() if MARKER in line]
    expected = PROCESSES.get(config, 1)
    # A launcher that started the processes but not one job (each alone, world 1) is a failure, not a figure.
    if proc.returncode != 0 or sorted((r["rank"], r["world"]) for r in ranks) != [
        (i, expected) for i in range(expected)
    ]:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        seen = [(r["rank"], r["world"]) for r in ranks]
        return {
            "error": f"exit code {proc.returncode}, (rank, world) {seen}, not ranks 0-{expected - 1} of {expected}:\n"
            f"{tail}",
            "load": load,
        }
    return {"ranks": sorted(ranks, key=lambda r: r["rank"]), "load": load}


def span(values: list[float], fmt: str = "{:.3f}") -> str:
    """Median (min-max) of a list, or the one value."""
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def summarize(model: str, rounds: list[dict[str, dict[str, Any]]], configs: list[str]) -> dict[str, Any]:
    """Per configuration: samples/s and ratios per round, peak RSS, final loss; and the goals."""
    out: dict[str, Any] = {}
    for config in configs:
        ok = [r[config] for r in rounds if config in r and "ranks" in r[config]]
        errors = [r[config]["error"] for r in rounds if config in r and "error" in r[config]]
        out[config] = {
            "samples_per_s": [m["ranks"][0]["samples_per_s"] for m in ok],
            "final_loss": [m["ranks"][0]["final_loss"] for m in ok],
            "peak_rss_mib": [[rank["peak_rss_mib"] for rank in m["ranks"]] for m in ok],
            "threads": ok[0]["ranks"][0]["threads"] if ok else None,
            "errors": errors,
        }

    def ratios(a: str, b: str) -> list[float]:
        both = [r for r in rounds if "ranks" in r.get(a, {}) and "ranks" in r.get(b, {})]
        return [r[a]["ranks"][0]["samples_per_s"] / r[b]["ranks"][0]["samples_per_s"] for r in both]

    for config in configs:
        out[config]["vs_plain"] = ratios(config, "plain")
    out["mwms_vs_ddp"] = ratios("mwms", "ddp")
    out["mwms_vs_accelerate"] = ratios("mwms", "accelerate")
    out["goals"] = [
        {
            "config": c,
            "against": b,
            "at_least": at,
            "ratios": ratios(c, b),
            "met": bool(ratios(c, b)) and statistics.median(ratios(c, b)) >= at,
        }
        for c, b, at in GOALS
        if c in configs and b in configs
    ]
    reference = out.get("plain", {}).get("final_loss", [])
    exact = [c for c in configs if c not in PER_REPLICA_BATCH_NORM or model != "resnet18"]
    losses = [x for c in exact for x in out[c]["final_loss"]]
    out["loss_spread"] = (max(losses) - min(losses)) / abs(reference[0]) if losses and reference else None
    return out


def render(summaries: dict[str, dict[str, Any]], configs: list[str], specs: dict[str, str]) -> str:
    lines = [
        "| model | configuration | samples/s | / plain | MWMS / it | peak RSS per process, MiB | final loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, s in summaries.items():
        for config in configs:
            c = s[config]
            if not c["samples_per_s"]:
                reason = c["errors"][0].splitlines()[0] if c["errors"] else "not run"
                lines.append(f"| {model} | {LABELS[config]} | {reason} | | | | |")
                continue
            per_process = [max(r[i] for r in c["peak_rss_mib"]) for i in range(len(c["peak_rss_mib"][0]))]
            against = {"ddp": s["mwms_vs_ddp"], "accelerate": s["mwms_vs_accelerate"]}.get(config, [])
            note = " (per-process BatchNorm)" if model == "resnet18" and config in PER_REPLICA_BATCH_NORM else ""
            lines.append(
                f"| {model} | {LABELS[config]} | {span(c['samples_per_s'], '{:.1f}')} | "
                f"{span(c['vs_plain']) if config != 'plain' else '1'} | {span(against)} | "
                f"{' + '.join(f'{x:.0f}' for x in per_process)} | {c['final_loss'][0]:.6f}{note} |"
            )
    lines += [
        "",
        "Final losses: largest spread over the configurations with the same arithmetic "
        "(relative to plain PyTorch's loss):",
    ]
    for model, s in summaries.items():
        spread = s["loss_spread"]
        lines.append(
            f"- {model}: {'-' if spread is None else f'{spread:.2e}'}"
            + (" (DDP and accelerate left out: per-process BatchNorm)" if model == "resnet18" else "")
        )
    lines += ["", "Goals of issue 29 item 4 (medians of the per-round ratios):"]
    for model, s in summaries.items():
        for g in s["goals"]:
            got = statistics.median(g["ratios"]) if g["ratios"] else float("nan")
            lines.append(
                f"- {model}: {LABELS[g['config']]} / {LABELS[g['against']]} >= {g['at_least']}: "
                f"{got:.3f} ({', '.join(f'{x:.3f}' for x in g['ratios'])}): "
                f"{'met' if g['met'] else 'NOT met'}"
            )
    lines += ["", "Models:"] + [f"- {m}: {d}" for m, d in specs.items()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet18,gpt2,bert")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"a subset of {','.join(CONFIGS)}")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, each running every configuration once")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (they train too)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 1 warm-up + 1 step, 1 round")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one configuration may take")
    parser.add_argument("--json", type=Path, default=Path("bench-results/real_models.json"))
    parser.add_argument(
        "--from-json", type=Path, help="print the table of a run saved with --json (even an unfinished one)"
    )
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.model, args.warmup, args.steps, args.quick, args.timeout)
        return 0
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        print(report(saved["header"], saved["rounds"], saved["configs"], saved["models"]))
        return 0
    if args.quick:
        args.warmup, args.steps, args.repeats = 1, 1, 1
    configs = [c.strip() for c in args.configs.split(",")]
    models = [m.strip() for m in args.models.split(",")]
    unknown = [c for c in configs if c not in CONFIGS] + [m for m in models if m not in MODEL_NAMES]
    if unknown:  # checked before torch is imported: a mistyped name is refused at once
        parser.error(f"unknown configuration or model: {unknown}. Configurations: {CONFIGS}; models: {MODEL_NAMES}")
    from stratagem.bench import real_models as rm
    from stratagem.cluster import allocator

    if "accelerate" in configs and importlib.util.find_spec("accelerate") is None:
        print("accelerate not installed: its column is left out (pip install accelerate)", file=sys.stderr)
        configs.remove("accelerate")
    env = {**os.environ, **allocator.keep_freed_memory_env(os.environ)}
    env["PYTHONWARNINGS"] = "ignore"
    env["GLOO_SOCKET_IFNAME"] = "lo"  # DDP's and accelerate's Gloo on loopback, as MWMS's rendezvous on 127.0.0.1
    started = time.time()
    specs = {m: (rm.MODELS_QUICK if args.quick else rm.MODELS)[m].describe() for m in models}
    rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in models}
    header = ""
    for r in range(args.repeats):
        for model in models:
            results: dict[str, Any] = {}
            rounds[model].append(results)
            for config in configs if r % 2 == 0 else configs[::-1]:
                results[config] = measure(config, model, args, env)
                m = results[config]
                shown = (
                    f"{m['ranks'][0]['samples_per_s']:.1f} samples/s, loss {m['ranks'][0]['final_loss']:.6f}"
                    if "ranks" in m
                    else f"FAILED: {m['error']}"
                )
                print(
                    f"round {r + 1} {model} {LABELS[config]}: {shown} (load {m['load']:.1f})",
                    file=sys.stderr,
                    flush=True,
                )
                loads = [x["load"] for rs in rounds.values() for rd in rs for x in rd.values()]
                header = (
                    f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, torch "
                    f"{__import__('torch').__version__}; {r + 1} of {args.repeats} round(s) of {args.warmup} "
                    f"warm-up + {args.steps} timed steps; allocator: {env.get('GLIBC_TUNABLES', 'glibc defaults')}"
                    f"; 1-minute load average before each configuration {min(loads):.1f}-{max(loads):.1f}; "
                    f"{time.time() - started:.0f} s in all"
                )
                # Saved after every configuration, so an interrupted run can still be read (--from-json).
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(
                    json.dumps({"header": header, "configs": configs, "rounds": rounds, "models": specs}, indent=2)
                )
    print(report(header, rounds, configs, specs))
    summaries = {m: summarize(m, rounds[m], configs) for m in models}
    failed = any(c["errors"] for s in summaries.values() for k, c in s.items() if k in configs)
    return 1 if failed else 0


def report(header: str, rounds: dict[str, list[dict[str, Any]]], configs: list[str], specs: dict[str, str]) -> str:
    summaries = {m: summarize(m, rs, configs) for m, rs in rounds.items()}
    return header + "\n\n" + render(summaries, configs, specs)


if __name__ == "__main__":
    raise SystemExit(main())
