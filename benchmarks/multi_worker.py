"""Issue 3's benchmarks: MultiWorkerMirroredStrategy vs DistributedDataParallel (2 processes, Gloo,
same threads per process) on the MLP and CNN workloads, and the bucketed all-reduce path vs raw
torch.distributed.all_reduce.

    .venv/bin/python benchmarks/multi_worker.py                  # 3 rounds, 20 warm-up + 200 steps
    .venv/bin/python benchmarks/multi_worker.py --rounds 1 --steps 50

Each round runs DDP, MWMS, DDP (ratios against the mean of the two DDP runs of the round).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from stratagem.bench.suite import suite_parser


def run(argv: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def main() -> int:
    args = suite_parser(__doc__, Path("bench-results/multi_worker.json")).parse_args()
    out: dict = {"training": {}, "allreduce": None}
    lines = ["| workload | DDP samples/s (median) | MWMS samples/s (median) | MWMS / DDP (median) | per round |",
             "|---|---|---|---|---|"]
    for workload in args.workloads.split(","):
        common = ["--workload", workload, "--world", "2", "--warmup", str(args.warmup), "--steps", str(args.steps)]
        ddp, mwms, ratios = [], [], []
        for r in range(args.rounds):
            before = run(["stratagem.bench.multi_process", "ddp", *common])["samples_per_s"]
            ours = run(["stratagem.bench.multi_process", "mwms", *common])["samples_per_s"]
            after = run(["stratagem.bench.multi_process", "ddp", *common])["samples_per_s"]
            ddp += [before, after]
            mwms.append(ours)
            ratios.append(ours / ((before + after) / 2))
            print(f"{workload} round {r + 1}: DDP {before:.0f}/{after:.0f}, MWMS {ours:.0f} samples/s", file=sys.stderr)
        out["training"][workload] = {"ddp": ddp, "mwms": mwms, "ratios": ratios}
        lines.append(f"| {workload} | {statistics.median(ddp):.0f} | {statistics.median(mwms):.0f} | "
                     f"{statistics.median(ratios):.3f} | {', '.join(f'{x:.3f}' for x in ratios)} |")
    allreduce = run(["stratagem.bench.allreduce"])
    out["allreduce"] = allreduce
    a, b = allreduce["a_64MiB"], allreduce["b_500x4KiB"]
    lines += ["", "| all-reduce (2 processes, Gloo) | raw | bucketed path | ratio |", "|---|---|---|---|",
              f"| (a) one 64 MiB tensor | {a['raw_s'] * 1e3:.1f} ms | {a['bucketed_s'] * 1e3:.1f} ms | "
              f"{a['bucketed_vs_raw']:.3f}x raw throughput |",
              f"| (b) 500 tensors of 4 KiB | {b['per_tensor_s'] * 1e3:.1f} ms (one all_reduce each) | "
              f"{b['bucketed_s'] * 1e3:.1f} ms | {b['speedup_vs_per_tensor']:.1f}x faster |"]
    print("\n".join(lines))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
