"""The cost of ShardedStrategy's batch check (`check_batches`, on by default): each worker's fingerprint of the
step's global batch, sent in one small all-reduce of its own at the start of every `run` and compared after it.

Two processes on 127.0.0.1 train the MLP workload (512 -> 1024 -> 1024 -> 10, global batch 256, stage 3) with
the check as it ships; blocks of 20 training steps alternate with blocks of 20 `strategy.barrier()` calls, which
go through the same bounded all-reduce of the worker group as the check (1 number instead of 2 x 28): the
check's collective. After each pair the check's own work on the training thread (the fingerprint of one
global batch, its slots, the comparison) is timed 20 times in the same process. Prints the median (with range)
of each per step, and their sum as a share of the median step time. Interleaved, so a loaded machine moves
both sides alike.

    .venv/bin/python benchmarks/sharded_batch_check.py --blocks 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _rank(rank: int, port: int, blocks: int, warmup: int, queue) -> None:
    import torch
    import torch.distributed as dist

    import stratagem as sg
    from stratagem.bench.throughput import make_train_step
    from stratagem.bench.workloads import WORKLOADS
    from stratagem.strategies.multi_worker.agreement import SLOT, BatchAgreement

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    workload = WORKLOADS["mlp"]
    cluster = {
        "cluster": {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]},
        "task": {"type": "worker", "index": rank},
    }
    strategy = sg.ShardedStrategy(stage=3, cluster=cluster, timeout=120)
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
    alone = BatchAgreement(rank=0, task_names=["worker:0", "worker:1"], strategy="ShardedStrategy")
    x, y = batches[0]

    def timed(fn, n: int = 20) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn(n)
        dist.barrier()  # the slowest rank's time
        return (time.perf_counter() - t0) / n

    def barriers(n: int) -> None:
        for _ in range(n):
            strategy.barrier()

    def fingerprints(n: int) -> None:
        for _ in range(n):
            alone.note_global_batch((x, y), len(x))
            mine = alone.numbers(1)[:SLOT]
            alone.check(mine * 2, 1)

    step_s, collective_s, own_s = [], [], []
    for b in range(blocks):
        for kind in ("step", "collective") if b % 2 == 0 else ("collective", "step"):
            if kind == "step":
                step_s.append(timed(block))
            else:
                collective_s.append(timed(barriers))
        own_s.append(timed(fingerprints))
    if rank == 0:
        queue.put({"step_s": step_s, "collective_s": collective_s, "own_s": own_s})
    strategy.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=10, help="rounds of 20 steps and 20 barriers (default 10)")
    parser.add_argument("--warmup", type=int, default=10, help="warm-up steps (default 10)")
    args = parser.parse_args()
    from stratagem.bench.multi_process import spawn_ranks

    r = spawn_ranks(_rank, 2, "PORT", args.blocks, args.warmup)

    def us(values: list[float]) -> str:
        v = sorted(values)
        return f"median {statistics.median(v) * 1e6:.0f} us (range {v[0] * 1e6:.0f}-{v[-1] * 1e6:.0f})"

    step = statistics.median(r["step_s"])
    cost = statistics.median(r["collective_s"]) + statistics.median(r["own_s"])
    print(f"step: median {step * 1e3:.1f} ms over {len(r['step_s'])} blocks of 20")
    print(f"the check's all-reduce (a barrier): {us(r['collective_s'])}; its own work: {us(r['own_s'])}")
    print(f"together {cost * 1e6:.0f} us a step, {cost / step:.2%} of the median step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
