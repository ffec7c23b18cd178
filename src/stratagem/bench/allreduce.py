"""The bucketed gradient path against raw `torch.distributed.all_reduce`, 2 processes, Gloo, 127.0.0.1.

    python -m stratagem.bench.allreduce

(a) one 64 MiB gradient: raw all_reduce of the tensor vs the bucketed path (weighting included);
(b) 500 gradients of 4 KiB: one raw all_reduce per tensor vs the bucketed path (fused).
The bucketed path runs twice: over Gloo, and over the shared-memory sum MultiWorkerMirroredStrategy
uses when every worker is on one host (``stratagem.shm.sums``), which is what it does
here. Each figure is the median over repetitions of the slowest rank's time. Rank 0 prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratagem.bench.multi_process import spawn_ranks
from stratagem.collective.buckets import GradientBuckets
from stratagem.shm import sums


def _timed(fn, repeats: int, prepare=None) -> float:
    times = []
    for _ in range(repeats):
        if prepare is not None:
            prepare()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
        times.append(float(elapsed))
    return statistics.median(times)


def _bucketed(params: list[nn.Parameter], weight: float, shared=None):
    """The bucketed path's step, and (untimed) what backward after zero_grad() leaves: each parameter's
    own gradient tensor, to be copied into its bucket (hand_out() makes the gradients bucket views).
    With ``shared`` (a shared-memory group) each bucket is summed there instead of by Gloo."""
    buckets = GradientBuckets(params)
    own = [p.grad for p in params]

    def prepare() -> None:
        for p, grad in zip(params, own):
            p.grad = grad

    def launch(t: torch.Tensor):
        if shared is not None:
            shared.all_reduce_(t, what="bucket", step=0)
            return None
        return dist.all_reduce(t, async_op=True)

    def run() -> None:
        buckets.start(weight)
        for i in reversed(range(len(params))):
            buckets.mark_ready(i, launch)
        for work in buckets.finish(launch):
            if work is not None:
                work.wait()
        buckets.hand_out()

    return run, prepare, buckets


def _rank(rank: int, world: int, port: int, repeats: int, queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    weight = 1.0 / world

    def failed(what: str, step: int, error: Exception | None) -> Exception:
        return RuntimeError(f"the shared-memory {what} failed: {error or 'timed out'}")

    shared, why, _ = sums.connect(
        store,
        rank=rank,
        world_size=world,
        task_names=[f"rank {r}" for r in range(world)],
        timeout=120,
        stall_warning_after=60,
        on_failure=failed,
        on_stall=lambda *args: None,
    )
    if shared is None:
        raise RuntimeError(f"the shared-memory path cannot run here: {why}")
    results: dict[str, Any] = {}

    big = nn.Parameter(torch.zeros(16 * 1024 * 1024))  # 64 MiB of float32
    big.grad = torch.ones_like(big)
    raw_big = _timed(lambda: dist.all_reduce(big.grad), repeats)
    run, prepare, buckets = _bucketed([big], weight)
    bucketed_big = _timed(run, repeats, prepare)
    run_unweighted, prepare, _ = _bucketed([big], 1.0)
    bucketed_big_unweighted = _timed(run_unweighted, repeats, prepare)
    big.grad = torch.ones_like(big)  # the unweighted runs doubled it at each repetition
    run, prepare, _ = _bucketed([big], weight, shared)
    shared_big = _timed(run, repeats, prepare)
    big_ok = torch.equal(big.grad, torch.ones_like(big))  # weighted by 1/world and summed: ones again
    results["a_64MiB"] = {
        "raw_s": raw_big,
        "bucketed_s": bucketed_big,
        "bucketed_vs_raw": raw_big / bucketed_big,
        "bucketed_unweighted_s": bucketed_big_unweighted,
        "bucketed_unweighted_vs_raw": raw_big / bucketed_big_unweighted,
        "shared_memory_s": shared_big,
        "shared_memory_vs_raw": raw_big / shared_big,
        "buckets": buckets.describe(),
    }

    small = [nn.Parameter(torch.zeros(1024)) for _ in range(500)]  # 500 x 4 KiB
    for p in small:
        p.grad = torch.ones_like(p)

    def per_tensor() -> None:
        for p in small:
            dist.all_reduce(p.grad)

    raw_small = _timed(per_tensor, max(3, repeats // 2))
    for p in small:
        p.grad = torch.ones_like(p)
    run, prepare, buckets = _bucketed(small, weight)
    bucketed_small = _timed(run, repeats, prepare)
    # The bucketed path's arithmetic: every rank holds ones, weighted by 1/world and summed: ones again.
    assert small[0].grad is not None  # set to ones above; the sums write into it
    check_ok = torch.equal(small[0].grad, torch.ones(1024))
    for p in small:
        p.grad = torch.ones_like(p)
    run, prepare, _ = _bucketed(small, weight, shared)
    shared_small = _timed(run, repeats, prepare)
    results["b_500x4KiB"] = {
        "per_tensor_s": raw_small,
        "bucketed_s": bucketed_small,
        "speedup_vs_per_tensor": raw_small / bucketed_small,
        "shared_memory_s": shared_small,
        "shared_memory_speedup_vs_per_tensor": raw_small / shared_small,
        "buckets": buckets.describe(),
    }
    assert small[0].grad is not None
    results["check_ok"] = bool(check_ok and big_ok and torch.equal(small[0].grad, torch.ones(1024)))
    shared.close()
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    json.dump(spawn_ranks(_rank, 2, 2, "PORT", args.repeats), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
