"""The cost of MultiWorkerMirroredStrategy's batch check (`check_batches`): the workers' fingerprint of each
step's global batch, sent with the gradient sum and compared after it.

Two processes on 127.0.0.1 train the MLP workload (512 -> 1024 -> 1024 -> 10, global batch 256) under one
strategy; blocks of 20 steps alternate between `check_batches=True` and False (which goes first alternates
too), each block timed between barriers, and every block distributes its batches as it iterates them
(`distribute_dataset` over a list of global batches, so the fingerprint hashes each whole global batch:
the dearest case; a DataLoader cut at the index level hashes its indices instead). Prints each side's
samples/s and the median (with range) of the per-block ratios. On a loaded machine those ratios scatter
by tens of percent, so after each pair of blocks the check's own work (fingerprint of one global batch,
its slots, the comparison) is also timed 20 times in the same process, and printed per step and as a
share of the median step time: that is the cost on the training thread; the check's 27 numbers per
worker added to an all-reduce of 3.4 MB of gradients are not measurable.

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
    from stratagem.strategies.worker_group.agreement import SLOT, BatchAgreement

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
    alone = BatchAgreement(rank=0, task_names=["worker:0", "worker:1"])
    x, y = batches[0]
    own: list[float] = []

    def check_alone() -> float:
        t0 = time.perf_counter()
        for _ in range(20):
            alone.note_global_batch((x, y), len(x))
            mine = alone.numbers(1)[:SLOT]
            alone.check(mine * 2, 1)
        return (time.perf_counter() - t0) / 20

    seconds: dict[bool, list[float]] = {True: [], False: []}
    for b in range(blocks):
        for check in (True, False) if b % 2 == 0 else (False, True):
            strategy.check_batches = check
            dist.barrier()
            t0 = time.perf_counter()
            block(20)
            dist.barrier()  # the slowest rank's time
            seconds[check].append(time.perf_counter() - t0)
        own.append(check_alone())
    if rank == 0:
        ratios = [on / off for on, off in zip(seconds[True], seconds[False])]
        queue.put(
            {
                "samples_per_s": {str(k): blocks * 20 * workload.global_batch / sum(v) for k, v in seconds.items()},
                "ratios": ratios,
                "check_s": own,
                "step_s": [t / 20 for t in seconds[False]],
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
    own, step = sorted(r["check_s"]), statistics.median(r["step_s"])
    print(
        f"the check's own work: median {statistics.median(own) * 1e6:.0f} us a step (range {own[0] * 1e6:.0f}-"
        f"{own[-1] * 1e6:.0f}), {statistics.median(own) / step:.2%} of the median step ({step * 1e3:.1f} ms)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
