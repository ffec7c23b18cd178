"""Throughput of data parallelism across processes: stratagem's MultiWorkerMirroredStrategy against
PyTorch DistributedDataParallel, same workload, same threads per process, Gloo on 127.0.0.1.

    python -m stratagem.bench.multi_process mwms --workload mlp --world 2
    python -m stratagem.bench.multi_process ddp  --workload mlp --world 2
    python -m stratagem.bench.multi_process mwms-gloo --workload mlp --world 2   # MWMS with shared_memory=False

Each rank runs in its own process; the clock starts and stops at a barrier, so the figure is
that of the slowest rank. Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stratagem.bench.throughput import (
    Measurement,
    make_train_step,
    strategy_steps,
    timed_steps,
)
from stratagem.bench.workloads import WORKLOADS
from stratagem.cluster.rendezvous import import_group_defaults

if TYPE_CHECKING:
    from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_side(workload: Any, rank: int, world: int) -> Callable[[int], torch.Tensor]:
    """Step ``i`` of DistributedDataParallel on this rank's slice of the global batches (process group set up)."""
    model = torch.nn.parallel.DistributedDataParallel(workload.build_model())
    train_step = make_train_step(model, workload.build_optimizer(model))
    per = workload.global_batch // world
    data = [(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]) for x, y in workload.make_batches()]
    return lambda i: train_step(*data[i % len(data)])


def mwms_side(
    workload: Any, rank: int, world: int, port: int, shared_memory: bool | None = None
) -> tuple[Any, Callable[[int], torch.Tensor]]:
    """A MultiWorkerMirroredStrategy over ``world`` ranks on 127.0.0.1 from ``port``, and its step ``i``."""
    import stratagem as sg

    cluster = {
        "cluster": {"worker": [f"127.0.0.1:{port}"] + [f"127.0.0.1:{port + 1 + r}" for r in range(world - 1)]},
        "task": {"type": "worker", "index": rank},
    }
    strategy = sg.MultiWorkerMirroredStrategy(["cpu:0"], cluster=cluster, timeout=120, shared_memory=shared_memory)
    step = strategy_steps(strategy, workload)
    return strategy, lambda i: strategy.experimental_local_results(step(i))[0]


def _rank_main(
    rank: int, config: str, workload_name: str, world: int, port: int, warmup: int, steps: int, threads: int, queue
) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(threads)
    workload = WORKLOADS[workload_name]
    if config == "ddp":
        import_group_defaults()  # as stratagem's rendezvous does, so destroy_process_group() frees the group
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        step = ddp_side(workload, rank, world)
    else:
        _, step = mwms_side(workload, rank, world, port, shared_memory=False if config == "mwms-gloo" else None)
    elapsed, loss = timed_steps(step, warmup, steps, barrier=dist.barrier)
    if rank == 0:
        queue.put(
            asdict(
                Measurement(
                    config,
                    workload_name,
                    world,
                    steps,
                    elapsed,
                    steps * workload.global_batch / elapsed,
                    float(loss.detach()),
                    threads,
                )
            )
        )
    del step, loss
    free_ddp_models()
    dist.destroy_process_group()


def free_ddp_models() -> None:
    """Frees the DistributedDataParallel models the caller has let go of, while the process group is still
    alive: drop every reference to them, call this, then ``destroy_process_group()``.

    A DDP model's reducer holds the process group. If the reducer is the group's last holder, freeing it
    destroys the group with the GIL held (pybind11 frees the reducer so), and the group's destructor joins
    Gloo's threads; a Gloo thread that is just then freeing a finished all-reduce launched during backward
    needs the GIL (the work keeps a Python object torch's backward stashes), so each waits for the other
    forever. Seen once in about 25 runs of the interleaved benchmark, as a rank that never exits (py-spy:
    the main thread in ~ProcessGroupGloo under ~Reducer, a Gloo thread in gil_scoped_acquire). Freed
    first, the reducer only drops a reference, and destroy_process_group then destroys the group with the
    GIL released."""
    gc.collect()  # a DDP model in a reference cycle is freed here rather than at some later collection


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config", choices=["ddp", "mwms", "mwms-gloo"])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mlp")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--threads", type=int, default=None, help="intra-op threads per process (default: cores / world)"
    )
    args = parser.parse_args(argv)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.world)
    result = spawn_ranks(
        _rank_main, args.world, args.config, args.workload, args.world, "PORT", args.warmup, args.steps, threads
    )
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


def spawn_ranks(target, world: int, *args, timeout: float = 600, start_method: str = "spawn") -> dict:
    """Runs `target(rank, *args, queue)` in `world` spawned processes ("PORT" in `args` becomes a free
    loopback port); returns what rank 0 put on the queue, or raises naming the ranks that failed.
    `start_method="forkserver"` forks each rank from a server process that has already imported
    torch (see `multiprocessing.set_forkserver_preload`), sparing every rank seconds of imports."""
    # Every context get_context returns has Process; typeshed types its str overload as BaseContext, which has not.
    ctx = cast("SpawnContext | ForkServerContext | ForkContext", mp.get_context(start_method))
    queue = ctx.SimpleQueue()
    port = _free_port()
    args = tuple(port if a == "PORT" else a for a in args)
    procs = [ctx.Process(target=target, args=(r, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
        if p.exitcode is None:
            p.kill()
    if any(p.exitcode != 0 for p in procs) or queue.empty():
        raise RuntimeError(f"a benchmark rank failed: exit codes {[p.exitcode for p in procs]}")
    return queue.get()


if __name__ == "__main__":
    raise SystemExit(main())
