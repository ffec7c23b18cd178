"""A reduce-scatter of SUM through Gloo three ways, between 2 (or --workers) processes on this host: Gloo's own
`reduce_scatter_tensor`, an all-reduce of the whole input keeping one chunk, and one `all_to_all_single` followed by
a sum of the rows received (what ShardedStrategy's reduce-scatter does through Gloo: sharded/reduce_scatter.py).
Wall and CPU milliseconds per call, the median of --rounds rounds of 10 calls, each way in turn within a round.

    .venv/bin/python benchmarks/gloo_reduce_scatter.py                 # 4 MiB and 16 MiB of float32, 2 workers
    .venv/bin/python benchmarks/gloo_reduce_scatter.py --workers 3 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def worker(rounds: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for numel in (1 << 20, 4 << 20):
        numel -= numel % world
        inp = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        out = torch.empty(numel // world)
        rows = torch.empty(numel)

        def gloo_reduce_scatter() -> None:
            dist.reduce_scatter_tensor(out, inp)

        def all_reduce_keep_chunk() -> None:
            whole = inp.clone()
            dist.all_reduce(whole)
            out.copy_(whole.view(world, -1)[rank])

        def all_to_all_sum() -> None:
            dist.all_to_all_single(rows, inp)
            torch.sum(rows.view(world, -1), dim=0, out=out)

        ways = (gloo_reduce_scatter, all_reduce_keep_chunk, all_to_all_sum)
        wall: dict[str, list[float]] = {f.__name__: [] for f in ways}
        cpu: dict[str, list[float]] = {f.__name__: [] for f in ways}
        for _ in range(rounds):
            for f in ways:
                f()
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(10):
                    f()
                wall[f.__name__].append((time.perf_counter() - t0) * 100)
                cpu[f.__name__].append((time.process_time() - c0) * 100)
        gloo_reduce_scatter()
        expected = out.clone()
        all_to_all_sum()
        result = {
            "rank": rank,
            "workers": world,
            "MiB": numel * 4 / 2**20,
            "wall_ms": {k: round(statistics.median(v), 2) for k, v in wall.items()},
            "cpu_ms": {k: round(statistics.median(v), 2) for k, v in cpu.items()},
            "largest_difference": float((expected - out).abs().max()),
        }
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.rounds)
        return
    from stratagem import environ
    from stratagem.cluster import launch

    lines: list[str] = []
    launch(
        [sys.executable, __file__, "--worker", "--rounds", str(args.rounds)],
        workers=args.workers,
        env=dict(environ.current()),
        sink=lambda line: lines.append(line.text),
        timeout=600,
    )
    print(
        "| MiB | rank | Gloo reduce_scatter: wall; CPU ms | all-reduce, keep chunk | all-to-all + sum | largest difference |"
    )
    print("|---|---|---|---|---|---|")
    for line in lines:
        if "RESULT " not in line:
            continue
        r = json.loads(line.split("RESULT ", 1)[1])
        cells = [f"{r['wall_ms'][k]}; {r['cpu_ms'][k]}" for k in r["wall_ms"]]
        print(f"| {r['MiB']:.0f} | {r['rank']} | " + " | ".join(cells) + f" | {r['largest_difference']:.1e} |")


if __name__ == "__main__":
    main()
