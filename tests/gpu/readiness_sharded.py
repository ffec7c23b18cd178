"""The readiness section `sharded`: ShardedStrategy on GPUs at N=2 (issue 25, item 5).

- speed: stage 2 against torch's DistributedDataParallel on an MLP both fit, interleaved blocks of steps
  in the same two processes; goal: median samples/s ratio >= 0.95;
- capacity: the largest MLP (blocks of Linear(w, w), AdamW) one GPU trains under a memory cap (what DDP,
  holding the same whole copy per GPU, can at most train), then a model 1.8x its size trained by
  ShardedStrategy at N=2 under the same cap.

Each case starts two worker processes as `stratagem launch --workers 2` does (each takes the GPU of its
local rank). A GPU run needs two GPUs; the dry run runs both cases small on the CPU over Gloo (no goals).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve()
CAP_BYTES = 4 * 2**30
"""The memory cap of the capacity case on a GPU: small enough that the models build in seconds."""


def sharded(ctx: Any) -> dict[str, Any]:
    gpu = not ctx.dry_run
    return {name: ctx.case(name, lambda name=name: _launch(name, gpu)) for name in ("speed", "capacity")}


def _launch(case: str, gpu: bool) -> dict[str, Any]:
    from stratagem import environ
    from stratagem.cluster import launch

    if gpu and torch.cuda.device_count() < 2:
        raise RuntimeError(
            f"ShardedStrategy at N=2 needs two GPUs (one per worker process); this machine has "
            f"{torch.cuda.device_count()}. Run this section on a machine with two."
        )
    lines: list[str] = []
    command = [sys.executable, str(HERE), "--worker", case] + ([] if gpu else ["--dry-run"])
    env = dict(environ.current(), PYTHONPATH=os.pathsep.join([str(HERE.parent.parent.parent / "src"), *sys.path]))
    result = launch(command, workers=2, env=env, sink=lambda line: lines.append(line.text), timeout=240)
    rows = [json.loads(t) for t in lines if t.startswith("{")]
    if result.exit_code != 0 or len(rows) != 2:
        raise RuntimeError(f"the workers exited with code {result.exit_code}:\n" + "\n".join(lines[-30:]))
    if "error" in rows[0]:
        raise RuntimeError(rows[0]["error"])
    return rows[0]


def mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)])


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def speed(gpu: bool) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import stratagem as sg

    strategy = sg.ShardedStrategy(stage=2, timeout=120)
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if gpu else torch.device("cpu")
    width, depth, batch, blocks, steps = (4096, 8, 1024, 5, 20) if gpu else (64, 2, 16, 2, 2)
    ddp = DistributedDataParallel(mlp(width, depth).to(device), device_ids=[device.index] if gpu else None)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    net = mlp(width, depth)
    model, opt = strategy.distribute(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
    x = torch.randn(batch, width)
    [(part,)] = list(strategy.distribute_dataset([(x,)]))  # this worker's half, as strategy.run takes it
    mine = x[rank * batch // 2 : (rank + 1) * batch // 2].to(device)

    def timed(step: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if gpu:
            torch.cuda.synchronize(device)
        dist.barrier()
        return steps * batch / (time.perf_counter() - start)

    ratios = []
    for _ in range(blocks):  # interleaved: a slow spell of the machine falls on both
        plain = timed(lambda: _step(ddp, ddp_opt, mine))
        ours = timed(lambda: strategy.run(lambda xs: _step(model, opt, xs.to(device)), args=(part,)))
        ratios.append(ours / plain)
    strategy.close()
    median = statistics.median(ratios)
    if gpu and median < 0.95:
        raise AssertionError(f"stage 2 reached {median:.2f}x DDP's samples/s (blocks: {ratios}); the goal is 0.95x")
    return {"median_ratio_to_ddp": median, "ratios": ratios, "width": width, "depth": depth, "batch": batch}


def capacity(gpu: bool) -> dict[str, Any]:
    import torch.distributed as dist

    import stratagem as sg

    strategy = sg.ShardedStrategy(stage=3, timeout=120)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if gpu else torch.device("cpu")
    width, batch = (2048, 64) if gpu else (32, 8)
    cap = CAP_BYTES if gpu else 16 * (width * width + width) * 6  # the dry run: 6 blocks' worth of state
    if gpu:
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(device).total_memory, device)

    def fits_one_device(depth: int) -> bool:
        if not gpu:  # no allocator to cap: the whole copy's parameters, gradients and AdamW state against the cap
            return 16 * sum(p.numel() for p in mlp(width, depth).parameters()) <= cap
        try:
            model = mlp(width, depth).to(device)
            _step(model, torch.optim.AdamW(model.parameters()), torch.randn(batch, width, device=device))
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            torch.cuda.empty_cache()

    block = 16 * (width * width + width)  # bytes of one block's parameters, gradients and AdamW state
    depth = max(1, cap // block)
    while depth > 1 and not fits_one_device(depth):
        depth -= 1
    while fits_one_device(depth + 1):
        depth += 1
    agreed = torch.tensor([depth], device=device if gpu else "cpu")
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # both ranks try the same sharded model
    largest = int(agreed)
    bigger = math.ceil(1.8 * largest)
    net = mlp(width, bigger)
    model, opt = strategy.distribute(net, torch.optim.AdamW(net.parameters()))
    plan = strategy.memory_plan()
    del net
    x = torch.randn(batch, width)
    for (xs,) in strategy.distribute_dataset([(x,)] * 3):
        strategy.run(lambda xs: _step(model, opt, xs.to(device)), args=(xs,))
    peak = torch.cuda.max_memory_allocated(device) if gpu else plan.total
    strategy.close()
    return {
        "one_device_largest_blocks": largest,
        "sharded_blocks": bigger,
        "ratio": bigger / largest,
        "cap_bytes": cap,
        "sharded_peak_bytes": peak,
        "planned_bytes": plan.total,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=("speed", "capacity"), required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    try:
        figures = (speed if args.worker == "speed" else capacity)(not args.dry_run)
    except Exception as error:  # noqa: BLE001 - printed for the section's report, with the reason
        figures = {"error": f"{type(error).__name__}: {error}"}
    print(json.dumps(figures), flush=True)
