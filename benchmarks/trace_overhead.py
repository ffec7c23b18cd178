"""What a trace costs (issue 42, item 6): samples/s of MultiWorkerMirrored (or, `--strategy sharded`, of
ShardedStrategy) with the trace off, in summary mode on a sample of the steps (fit's default), in summary mode on every step, and with full spans, in interleaved blocks on the same two worker processes.

Two workers under the local launcher (127.0.0.1, free ports) train one workload. After warm-up steps each
round runs one block of `--steps` steps per mode, the order of the modes rotating from round to round, so a
change in the machine's load falls on every mode alike. A block starts after a barrier and, for a traced
block, after `strategy.trace(DIR, mode=...)` has aligned the clocks; it ends before the trace writes its file,
so the steps alone are timed (in summary mode, with the block's steps folded: the recorder folds them in
batches, `trace/fold.py`). The one-off costs (entering the trace: the clock pings; leaving it: the file)
are reported apart. Per block: wall seconds, the process's CPU seconds (every thread, Gloo's included) and the
training thread's own CPU seconds per step on each worker; per traced block, the bytes of the worker's file per 100 steps.

Ratios are taken within a round (mode / off of the same round), then the median over rounds.

    .venv/bin/python benchmarks/trace_overhead.py --workload mlp --rounds 12 --steps 200
    .venv/bin/python benchmarks/trace_overhead.py --workload digits --rounds 8 --steps 60 --json out.json
    .venv/bin/python benchmarks/trace_overhead.py --workers 1 --rounds 30 --steps 100   # the hooks, one worker
    .venv/bin/python benchmarks/trace_overhead.py --strategy sharded --rounds 12 --steps 200   # FSDP2's units
    .venv/bin/python benchmarks/trace_overhead.py --recorder-only --rounds 7   # the recorder alone, replayed steps
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODES = ("off", "sampled", "summary", "spans")
""""sampled": summary mode on a sample of the steps, as `fit` leaves it on (`trace/sample.py`); "summary": every
step in summary mode; "spans": every span."""
WORKLOADS = {
    "mlp": "Linear(16, 32), Tanh, Linear(32, 4); global batch 32 (16 a worker): the steps of about a millisecond "
    "where a fixed cost per step shows most",
    "digits": "the conv net of `stratagem train` (demo/digits.py) on 1x8x8 inputs; global batch 256 (128 a worker), "
    "Adam",
}


def _workload(name: str):  # -> (model, optimizer, batches)
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        data = [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(16)]
        return net, torch.optim.SGD(net.parameters(), lr=0.01), data
    from stratagem.demo.digits import build_digits_model

    net = build_digits_model(0)
    data = [(torch.randn(256, 1, 8, 8, generator=g), torch.randint(0, 10, (256,), generator=g)) for _ in range(16)]
    return net, torch.optim.Adam(net.parameters(), lr=0.01), data


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    import stratagem as sg

    torch.set_num_threads(1)
    strategy = (
        sg.ShardedStrategy(timeout=120) if args.strategy == "sharded" else sg.MultiWorkerMirroredStrategy(timeout=120)
    )
    rank = strategy.cluster.rank
    net, optimizer, data = _workload(args.workload)
    model, opt = strategy.distribute(net, optimizer)

    def train_step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def batches(n: int):
        for i in range(n):
            yield data[i % len(data)]

    def steps(n: int) -> None:
        for x, y in strategy.distribute_dataset(batches(n)):
            strategy.run(train_step, args=(x, y))

    steps(args.warmup)
    directory = Path(args.dir)
    blocks = []
    for round_ in range(args.rounds):
        order = MODES[round_ % len(MODES) :] + MODES[: round_ % len(MODES)]
        for mode in order:
            strategy.barrier()
            entered = time.perf_counter()
            trace = recorder = None
            if mode != "off":
                trace = strategy.trace(directory / f"{mode}-{round_}", mode="spans" if mode == "spans" else "summary")
                recorder = trace.__enter__()
                if mode == "sampled":
                    recorder.sample_steps()
            gc0 = [g["collections"] for g in gc.get_stats()]
            wall0, cpu0, main0 = time.perf_counter(), time.process_time(), time.thread_time()
            steps(args.steps)
            fold0 = time.thread_time()
            if recorder is not None and recorder.folder is not None:
                recorder.folder.fold()  # summary mode folds in batches: the block's steps are timed folded
            fold = time.thread_time() - fold0
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            main = time.thread_time() - main0
            passes = [g["collections"] - c for g, c in zip(gc.get_stats(), gc0)]
            recorded = recorder.sample.num_recorded if recorder is not None and recorder.sample is not None else None
            left = time.perf_counter()
            nbytes = None
            if trace is not None:
                trace.__exit__(None, None, None)
                nbytes = (directory / f"{mode}-{round_}" / f"worker-{rank}.json").stat().st_size
            blocks.append(
                {"round": round_, "mode": mode, "wall_s": wall, "cpu_s": cpu, "main_cpu_s": main, "bytes": nbytes,
                 "enter_s": wall0 - entered, "leave_s": time.perf_counter() - left, "gc_passes": passes,
                 "recorded": recorded, "fold_cpu_s": fold}
            )  # fmt: skip
    print(json.dumps({"rank": rank, "blocks": blocks}), flush=True)
    strategy.close()


def summarize(per_rank: dict[int, list[dict]], steps: int, global_batch: int) -> dict:
    """Per mode: samples/s (the slower worker's wall time of each block), CPU ms per step (mean of the workers),
    and bytes per worker per 100 steps; ratios to the same round's untraced block, medians over rounds."""
    rounds = sorted({b["round"] for b in per_rank[0]})
    table: dict[str, dict] = {}
    by = {(r, b["round"], b["mode"]): b for r, blocks in per_rank.items() for b in blocks}
    ranks = sorted(per_rank)
    for mode in MODES:
        walls = [max(by[(r, k, mode)]["wall_s"] for r in ranks) for k in rounds]
        cpus = [statistics.fmean(by[(r, k, mode)]["cpu_s"] for r in ranks) for k in rounds]
        offs = [max(by[(r, k, "off")]["wall_s"] for r in ranks) for k in rounds]
        off_cpus = [statistics.fmean(by[(r, k, "off")]["cpu_s"] for r in ranks) for k in rounds]
        mains = [statistics.fmean(by[(r, k, mode)]["main_cpu_s"] for r in ranks) for k in rounds]
        off_mains = [statistics.fmean(by[(r, k, "off")]["main_cpu_s"] for r in ranks) for k in rounds]
        row = {
            "samples_per_s_median": round(statistics.median(steps * global_batch / w for w in walls), 1),
            "wall_ms_per_step_median": round(statistics.median(w / steps * 1e3 for w in walls), 4),
            "cpu_ms_per_step_median": round(statistics.median(c / steps * 1e3 for c in cpus), 4),
            "samples_per_s_ratio_to_off_median": round(statistics.median(o / w for w, o in zip(walls, offs)), 4),
            "samples_per_s_ratio_to_off_each_round": [round(o / w, 4) for w, o in zip(walls, offs)],
            "cpu_ratio_to_off_median": round(statistics.median(c / o for c, o in zip(cpus, off_cpus)), 4),
            # Paired within each round: what tracing adds to a step, in microseconds.
            "wall_us_per_step_over_off_median": round(
                statistics.median((w - o) / steps * 1e6 for w, o in zip(walls, offs)), 1
            ),
            "cpu_us_per_step_over_off_median": round(
                statistics.median((c - o) / steps * 1e6 for c, o in zip(cpus, off_cpus)), 1
            ),
            # The training thread's own CPU: no Gloo thread, no spinning for a peer.
            "main_thread_cpu_us_per_step_over_off_median": round(
                statistics.median((c - o) / steps * 1e6 for c, o in zip(mains, off_mains)), 1
            ),
        }
        row["gc_passes_per_block_median"] = [
            statistics.median(by[(r, k, mode)]["gc_passes"][g] for r in ranks for k in rounds) for g in range(3)
        ]
        # The block's last fold, timed in the block: a run folds every fold.BATCH recorded steps, so a sampled run
        # pays a few of these per 8,000 steps, where a block of `--steps` pays one.
        row["fold_at_block_end_us_per_step_median"] = round(
            statistics.median(by[(r, k, mode)]["fold_cpu_s"] / steps * 1e6 for r in ranks for k in rounds), 1
        )
        if mode == "sampled":
            row["steps_recorded_per_block_median"] = statistics.median(
                by[(r, k, mode)]["recorded"] for r in ranks for k in rounds
            )
        if mode != "off":
            sizes = [by[(r, k, mode)]["bytes"] for r in ranks for k in rounds]
            row["bytes_per_worker_per_100_steps"] = round(statistics.fmean(sizes) / steps * 100)
            row["enter_ms_median"] = round(
                statistics.median(by[(r, k, mode)]["enter_s"] * 1e3 for r in ranks for k in rounds), 2
            )
            row["leave_ms_median"] = round(
                statistics.median(by[(r, k, mode)]["leave_s"] * 1e3 for r in ranks for k in rounds), 2
            )
        table[mode] = row
    return table


def recorder_only(repeats: int, steps: int = 2000) -> dict:
    """The recorder's own CPU per step, without a strategy: the events of a millisecond step of the mlp job (input,
    forward, backward holding two collectives and their waits, optimizer step, the whole step; the straggler
    warning's `last_step_phases` once a step, as MultiWorkerMirrored asks it) replayed into a recorder, then its
    file's contents made (the steps folded). Thread CPU us per step, median of `repeats` interleaved passes."""
    from stratagem.trace import Recorder

    events: list[tuple] = []
    t = 10**12
    for k in range(steps):
        s = t + 60_000
        events += [("input", t, t + 50_000, {"batch": k}), ("phases",), ("forward", s, s + 100_000, None),
                   ("collective", s + 300_000), ("wait", s + 300_000, s + 400_000, {"seqs": [2 * k]}),
                   ("backward", s + 120_000, s + 450_000, None), ("collective", s + 460_000),
                   ("wait", s + 460_000, s + 480_000, {"seqs": [2 * k + 1]}),
                   ("optimizer", s + 500_000, s + 600_000, None), ("step", s, s + 700_000, None)]  # fmt: skip
        t = s + 750_000

    def replay(mode: str) -> float:
        rec = Recorder(rank=0, task="worker:0")
        rec.start(clock=lambda: 0, mode=mode)
        cpu0 = time.thread_time()
        for event in events:
            if event[0] == "collective":
                seq = rec.collective("all_reduce", "gradients", 1, 64, "gloo")
                rec.collectives[seq][7] = event[1]
                rec.done(seq, event[1] + 1000)
            elif event[0] == "phases":
                rec.last_step_phases()
            else:
                rec.span(event[0], event[0], event[1], event[2], args=event[3])
        rec.to_dict()
        return (time.thread_time() - cpu0) / steps * 1e6

    passes: dict[str, list[float]] = {"summary": [], "spans": []}
    for _ in range(repeats):
        for mode in passes:
            passes[mode].append(replay(mode))
    return {f"{mode}_us_per_step_median": round(statistics.median(v), 1) for mode, v in passes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mlp")
    parser.add_argument("--strategy", choices=("multi_worker", "sharded"), default="multi_worker")
    parser.add_argument("--rounds", type=int, default=12, help="rounds of one block per mode (default 12)")
    parser.add_argument("--steps", type=int, default=200, help="steps per block (default 200)")
    parser.add_argument("--warmup", type=int, default=50, help="steps before the first block (default 50)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2; 1: no peer to wait for)")
    parser.add_argument("--json", metavar="PATH", help="also write the results there")
    parser.add_argument(
        "--recorder-only", action="store_true", help="the recorder's own CPU per step on replayed steps (no workers)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.recorder_only:
        print(
            json.dumps(
                {"recorder_only": recorder_only(args.rounds), "load_average": [round(x, 2) for x in os.getloadavg()]}
            )
        )
        return
    if args.worker:
        worker(args)
        return

    from stratagem import environ
    from stratagem.cluster import launch

    with tempfile.TemporaryDirectory(prefix="trace-overhead-") as directory:
        argv = [sys.executable, __file__, "--worker", "--dir", directory, "--workload", args.workload,
                "--strategy", args.strategy, "--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup)]  # fmt: skip
        lines: list = []
        load = os.getloadavg()
        started = time.perf_counter()
        result = launch(
            argv, workers=args.workers, env=dict(environ.current()), sink=lines.append, timeout=3600, grace_period=2
        )
        took = time.perf_counter() - started
    if result.exit_code != 0:
        raise SystemExit("\n".join(f"[{line.task}] {line.text}" for line in lines[-40:]))
    per_rank = {}
    for line in lines:
        if line.text.startswith("{"):
            outcome = json.loads(line.text)
            per_rank[outcome["rank"]] = outcome["blocks"]
    global_batch = 32 if args.workload == "mlp" else 256
    report = {
        "workload": args.workload,
        "strategy": args.strategy,
        "workers": args.workers,
        "description": WORKLOADS[args.workload],
        "rounds": args.rounds,
        "steps_per_block": args.steps,
        "load_average_before": [round(x, 2) for x in load],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "elapsed_s": round(took, 1),
        "modes": summarize(per_rank, args.steps, global_batch),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
