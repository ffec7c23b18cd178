"""The cost of MultiWorkerMirroredStrategy's batch check (`check_batches`): the workers' fingerprint of each
step's global batch, sent with the gradient sum and compared after it.

Two processes on 127.0.0.1 train the MLP workload (512 -> 1024 -> 1024 -> 10, global batch 256) under one
strategy; blocks of 20 steps alternate between `check_batches=True` and False (which goes first alternates
too), each block timed between barriers, and every block distributes its batches as it iterates them
(`distribute_dataset` over a list of global batches, so the fingerprint hashes each whole global batch:
the dearest case; a DataLoader cut at the index level hashes its indices instead). Prints each side's
samples/s and the median (with range) of the per-block ratios.

    .venv/bin/python benchmarks/batch_check.py --blocks 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _rank(rank: int, port: int, blocks: int, warmup: int, shared_memory: bool | None, queue) -> None:
    import torch
    import torch.distributed as dist

    import stratagem as sg
    from stratagem.bench.throughput import make_train_step
    from stratagem.bench.workloads import WORKLOADS

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    workload = WORKLOADS["mlp"]
    cluster = {
        "cluster": {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]},
        "task": {"type": "worker", "index": rank},
    }
    strategy = sg.MultiWorkerMirroredStrategy(["cpu:0"], cluster=cluster, timeout=120, shared_memory=shared_memory)
    net = workload.build_model()
    model, optimizer = strategy.distribute(net, workload.build_optimizer(net))
    train_step = make_train_step(model, optimizer)
    batches = workload.make_batches()

    def block(n: int) -> None:
        for i, (x, y) in enumerate(strategy.distribute_dataset(batches)):
            if i == n:
                break
            strategy.run(train_step, args=(x, y))

    block(warmup)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for b in range(blocks):
        for check in (True, False) if b % 2 == 0 else (False, True):
            strategy.check_batches = check
            dist.barrier()
            t0 = time.perf_counter()
            block(20)
            dist.barrier()  # the slowest rank's time
            seconds[check].append(time.perf_counter() - t0)
    if rank == 0:
        ratios = [on / off for on, off in zip(seconds[True], seconds[False])]
        queue.put(
            {
                "samples_per_s": {str(k): blocks * 20 * workload.global_batch / sum(v) for k, v in seconds.items()},
                "ratios": ratios,
            }
        )
    strategy.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=20, help="pairs of 20-step blocks (default 20)")
    parser.add_argument("--warmup", type=int, default=20, help="warm-up steps (default 20)")
    parser.add_argument("--gloo", action="store_true", help="sum through Gloo instead of shared memory")
    args = parser.parse_args()
    from stratagem.bench.multi_process import spawn_ranks

    r = spawn_ranks(_rank, 2, "PORT", args.blocks, args.warmup, False if args.gloo else None)
    ratios = sorted(r["ratios"])
    print(
        f"check on: {r['samples_per_s']['True']:.0f} samples/s, off: {r['samples_per_s']['False']:.0f} samples/s; "
        f"step time on / off: median {statistics.median(ratios):.4f} (range {ratios[0]:.3f}-{ratios[-1]:.3f}) "
        f"over {len(ratios)} block pairs"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
