"""Issue 3's benchmarks: MultiWorkerMirroredStrategy vs DistributedDataParallel (2 processes, Gloo,
same threads per process) on the MLP and CNN workloads, and the bucketed all-reduce path vs raw
torch.distributed.all_reduce.

    .venv/bin/python benchmarks/multi_worker.py                  # 3 rounds, 20 warm-up + 200 steps
    .venv/bin/python benchmarks/multi_worker.py --rounds 1 --steps 50

Each round runs DDP, MWMS, DDP given MWMS's allocator setting, DDP (ratios against the mean of the two
plain DDP runs of the round). Each side starts as its launcher would start it: DDP with the environment
as it is (torchrun adds nothing to it), MWMS with what `stratagem launch` adds (GLIBC_TUNABLES: glibc keeps
freed memory for reuse, see stratagem.cluster.allocator). The third run is the control: DDP with that same
setting, so the table also shows MWMS against DDP in identical processes. --default-allocator runs MWMS
without the setting (and no control). On one machine MWMS sums gradients through shared memory (its
default when every worker is on one host); --also-gloo adds MWMS with shared_memory=False to each round;
with --interleaved it runs MWMS with shared_memory=False instead of its default.

    .venv/bin/python benchmarks/multi_worker.py --workloads mlp --interleaved 10

--interleaved N runs DDP and MWMS in the same two processes instead (one process group; each rank holds
a DDP model and a MWMS model), N blocks of 20 steps each, alternating which goes first, every block timed
between barriers; it prints each side's samples/s and the median of the per-block ratios, so that a
disturbance from other work on a shared machine hits both sides (both with the allocator setting, unless
--default-allocator).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from stratagem.bench.suite import suite_parser
from stratagem.cluster import allocator


def run(argv: list[str], extra_env: dict[str, str] | None = None) -> dict:
    env = {**os.environ, **(extra_env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", *argv], check=False, capture_output=True, text=True, timeout=900, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout[proc.stdout.index("{") :])


def _interleaved_rank(
    rank: int, workload_name: str, port: int, blocks: int, warmup: int, shared_memory: bool | None, queue
) -> None:
    """One rank of --interleaved: a MWMS model and a DDP model over the same process group, blocks alternating."""
    import torch
    import torch.distributed as dist

    from stratagem.bench.multi_process import ddp_side, free_ddp_models, mwms_side
    from stratagem.bench.workloads import WORKLOADS

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    workload = WORKLOADS[workload_name]
    strategy, mwms = mwms_side(workload, rank, 2, port, shared_memory)  # its process group serves DDP too
    sides = {"ddp": ddp_side(workload, rank, 2), "mwms": mwms}
    for run in sides.values():
        for i in range(warmup):
            run(i)
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for block in range(blocks):
        for name in list(sides) if block % 2 == 0 else list(sides)[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(block * 20, (block + 1) * 20):
                sides[name](i)
            dist.barrier()  # the slowest rank's time
            seconds[name].append(time.perf_counter() - t0)
    if rank == 0:
        ratios = [d / m for d, m in zip(seconds["ddp"], seconds["mwms"])]
        queue.put(
            {
                "workload": workload_name,
                "samples_per_s": {n: blocks * 20 * workload.global_batch / sum(t) for n, t in seconds.items()},
                "ratio_median": statistics.median(ratios),
                "ratios": ratios,
            }
        )
    del sides, run
    free_ddp_models()  # before the process group goes: see free_ddp_models
    strategy.close()


def main() -> int:
    parser = suite_parser(__doc__, Path("bench-results/multi_worker.json"))
    parser.add_argument(
        "--interleaved",
        type=int,
        metavar="BLOCKS",
        default=0,
        help="DDP vs MWMS in the same two processes, BLOCKS alternating blocks of 20 steps",
    )
    parser.add_argument(
        "--also-gloo",
        action="store_true",
        help="also run MWMS with shared_memory=False (gradients over Gloo) in each round; with "
        "--interleaved, run MWMS with shared_memory=False instead",
    )
    parser.add_argument(
        "--default-allocator",
        action="store_true",
        help="start MWMS's processes without the allocator setting `stratagem launch` gives its tasks "
        "(and run no control)",
    )
    args = parser.parse_args()
    launch_env = {} if args.default_allocator else allocator.keep_freed_memory_env(os.environ)
    if args.interleaved:
        from stratagem.bench.multi_process import spawn_ranks

        os.environ.update(launch_env)  # both sides share the two processes, so both run with it

        results = [
            spawn_ranks(
                _interleaved_rank, 2, w, "PORT", args.interleaved, args.warmup, False if args.also_gloo else None
            )
            for w in args.workloads.split(",")
        ]
        for r in results:
            print(
                f"{r['workload']}: DDP {r['samples_per_s']['ddp']:.0f} samples/s, MWMS {r['samples_per_s']['mwms']:.0f} "
                f"samples/s; MWMS / DDP median {r['ratio_median']:.3f} over {len(r['ratios'])} blocks"
            )
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        return 0
    out: dict = {"training": {}, "allreduce": None}
    control = bool(launch_env)
    lines = [
        "| workload | DDP samples/s (median) | MWMS samples/s (median) | MWMS / DDP (median) | per round |"
        + (" control: MWMS / DDP with MWMS's allocator setting (median) | per round |" if control else "")
        + (" MWMS over Gloo / DDP (median) | per round |" if args.also_gloo else ""),
        "|---|---|---|---|---|" + ("---|---|" if control else "") + ("---|---|" if args.also_gloo else ""),
    ]

    def cells(ratios: list[float]) -> str:
        return f" {statistics.median(ratios):.3f} | {', '.join(f'{x:.3f}' for x in ratios)} |"

    for workload in args.workloads.split(","):
        common = ["--workload", workload, "--world", "2", "--warmup", str(args.warmup), "--steps", str(args.steps)]
        ddp, mwms, ratios, kept, kept_ratios, gloo, gloo_ratios = [], [], [], [], [], [], []
        for r in range(args.rounds):
            before = run(["stratagem.bench.multi_process", "ddp", *common])["samples_per_s"]
            ours = run(["stratagem.bench.multi_process", "mwms", *common], launch_env)["samples_per_s"]
            over_gloo = (
                run(["stratagem.bench.multi_process", "mwms-gloo", *common], launch_env)["samples_per_s"]
                if args.also_gloo
                else None
            )
            ddp_kept = (
                run(["stratagem.bench.multi_process", "ddp", *common], launch_env)["samples_per_s"] if control else None
            )
            after = run(["stratagem.bench.multi_process", "ddp", *common])["samples_per_s"]
            ddp += [before, after]
            mwms.append(ours)
            ratios.append(ours / ((before + after) / 2))
            if ddp_kept is not None:
                kept.append(ddp_kept)
                kept_ratios.append(ours / ddp_kept)
            if over_gloo is not None:
                gloo.append(over_gloo)
                gloo_ratios.append(over_gloo / ((before + after) / 2))
            print(
                f"{workload} round {r + 1}: DDP {before:.0f}/{after:.0f}, MWMS {ours:.0f} samples/s"
                + (f", DDP with MWMS's allocator setting {ddp_kept:.0f}" if ddp_kept is not None else "")
                + (f", MWMS over Gloo {over_gloo:.0f}" if over_gloo is not None else ""),
                file=sys.stderr,
            )
        out["training"][workload] = {
            "ddp": ddp,
            "mwms": mwms,
            "ratios": ratios,
            "mwms_env": launch_env,
            "ddp_with_mwms_env": kept,
            "control_ratios": kept_ratios,
            "mwms_gloo": gloo,
            "mwms_gloo_ratios": gloo_ratios,
        }
        lines.append(
            f"| {workload} | {statistics.median(ddp):.0f} | {statistics.median(mwms):.0f} |"
            + cells(ratios)
            + (cells(kept_ratios) if kept_ratios else "")
            + (cells(gloo_ratios) if gloo_ratios else "")
        )
    allreduce = run(["stratagem.bench.allreduce"])
    out["allreduce"] = allreduce
    a, b = allreduce["a_64MiB"], allreduce["b_500x4KiB"]
    lines += [
        "",
        (
            "| all-reduce (2 processes) | raw Gloo | bucketed path over Gloo | ratio | bucketed path over shared "
            "memory (MWMS's on one host) | ratio |"
        ),
        "|---|---|---|---|---|---|",
        (
            f"| (a) one 64 MiB tensor | {a['raw_s'] * 1e3:.1f} ms | {a['bucketed_s'] * 1e3:.1f} ms | "
            f"{a['bucketed_vs_raw']:.3f}x raw throughput | {a['shared_memory_s'] * 1e3:.1f} ms | "
            f"{a['shared_memory_vs_raw']:.3f}x raw throughput |"
        ),
        (
            f"| (b) 500 tensors of 4 KiB | {b['per_tensor_s'] * 1e3:.1f} ms (one all_reduce each) | "
            f"{b['bucketed_s'] * 1e3:.1f} ms | {b['speedup_vs_per_tensor']:.1f}x faster | "
            f"{b['shared_memory_s'] * 1e3:.1f} ms | {b['shared_memory_speedup_vs_per_tensor']:.1f}x faster |"
        ),
    ]
    print("\n".join(lines))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
