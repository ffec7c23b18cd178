"""The cost of ShardedStrategy's batch check (`check_batches`, on by default): each worker's fingerprint of the
step's global batch, noted as the batch is cut, riding the step's first gradient reduce-scatter and compared when
it lands (`strategies/worker_group/step_agreement.py`).

Two processes on 127.0.0.1 train the MLP workload (512 -> 1024 -> 1024 -> 10, global batch 256, stage 3) in
blocks of 20 steps, three kinds interleaved (their order rotates from round to round):

- shipped: the check as it ships;
- none: no fingerprint and nothing sent (the check skipped on both workers alike);
- alone: the fingerprints summed in an all-reduce of their own at the start of `run`, before the step function
  (how the check was made before it rode the reduce-scatter), for comparison.

The kinds are switched by wrapping the check's parts in this script's processes (`BatchAgreement.
note_global_batch`, `StepAgreement.start`, `.ride`, `.landed`), which also time them on the training thread, as
is every call of the gradient reduce-scatter (`WeightedReduceScatter.__call__`, which copies the first unit's
gradients to make room for the fingerprints). Prints, with medians and ranges: the step time of each kind, the
per-round ratios of block times against "none" (on a loaded machine they scatter by several percent), the check's
own work per step (the fingerprint, its slots, the comparison) and the reduce-scatters' time per step with and
without the check, whose difference is the riding's cost.

    PYTHONPATH=src .venv/bin/python benchmarks/sharded_batch_check.py --blocks 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

KINDS = ("shipped", "none", "alone")
PARTS = ("fingerprint", "slots", "compare", "copies", "reduce-scatters", "collectives")


def _instrument(kind: list[str], spent: dict[str, float]) -> None:
    """Wraps the check's parts (before any strategy is built, so the strategy's hooks hold the wrappers): each
    adds its time on the training thread to `spent`; the check's are skipped when `kind[0]` is "none"."""
    import torch.distributed as dist

    from stratagem.strategies.sharded.reduce_scatter import WeightedReduceScatter
    from stratagem.strategies.worker_group.agreement import BatchAgreement
    from stratagem.strategies.worker_group.step_agreement import StepAgreement

    note, start, ride, landed = (
        BatchAgreement.note_global_batch,
        StepAgreement.start,
        StepAgreement.ride,
        StepAgreement.landed,
    )

    def timed(name, fn, skip=True):
        def wrapper(*args, **kwargs):
            if skip and kind[0] == "none":
                return None
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
                spent[name + " cpu"] += time.thread_time() - c0

        return wrapper

    def start_then_alone(self, step):
        start(self, step)
        if kind[0] == "alone":
            self.finish()

    BatchAgreement.note_global_batch = timed("fingerprint", note)
    StepAgreement.start = timed("slots", start_then_alone)
    StepAgreement.ride = timed("slots", ride)
    StepAgreement.landed = timed("compare", landed)
    WeightedReduceScatter.__call__ = timed("reduce-scatters", WeightedReduceScatter.__call__, skip=False)
    dist.reduce_scatter_tensor = timed("collectives", dist.reduce_scatter_tensor, skip=False)
    ride_fn = WeightedReduceScatter._ride

    def ride_copies(self, *args):
        # The riding's own work: its time less the reduce-scatter it makes and the comparison it calls.
        t0, others = time.perf_counter(), spent["collectives"] + spent["compare"]
        c0, others_cpu = time.thread_time(), spent["collectives cpu"] + spent["compare cpu"]
        try:
            return ride_fn(self, *args)
        finally:
            spent["copies"] += time.perf_counter() - t0 - (spent["collectives"] + spent["compare"] - others)
            spent["copies cpu"] += (
                time.thread_time() - c0 - (spent["collectives cpu"] + spent["compare cpu"] - others_cpu)
            )

    WeightedReduceScatter._ride = ride_copies


def _rank(rank: int, port: int, blocks: int, warmup: int, queue) -> None:
    import torch
    import torch.distributed as dist

    kind = ["shipped"]
    spent = dict.fromkeys(PARTS + tuple(p + " cpu" for p in PARTS), 0.0)
    _instrument(kind, spent)

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
    strategy = sg.ShardedStrategy(stage=3, cluster=cluster, timeout=120)
    net = workload.build_model()
    model, optimizer = strategy.distribute(net, workload.build_optimizer(net))
    train_step = make_train_step(model, optimizer)
    batches = workload.make_batches()
    n = 20

    def block() -> None:
        for i, (x, y) in enumerate(strategy.distribute_dataset(batches)):
            if i == n:
                break
            strategy.run(train_step, args=(x, y))

    for _ in range(max(1, warmup // n)):
        block()
    step_s: dict[str, list[float]] = {k: [] for k in KINDS}
    parts: dict[str, dict[str, list[float]]] = {k: {p: [] for p in spent} for k in KINDS}
    step_cpu: dict[str, list[float]] = {k: [] for k in KINDS}
    for b in range(blocks):
        for k in KINDS[b % 3 :] + KINDS[: b % 3]:
            kind[0] = k
            before = dict(spent)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            block()
            step_cpu[k].append((time.thread_time() - c0) / n)
            dist.barrier()  # the slowest rank's time
            step_s[k].append((time.perf_counter() - t0) / n)
            for name in spent:
                parts[k][name].append((spent[name] - before[name]) / n)
    kind[0] = "shipped"
    gathered = [None, None]
    dist.all_gather_object(
        gathered, (parts, step_cpu)
    )  # this rank's training-thread times; the report takes the larger
    if rank == 0:
        queue.put({"step_s": step_s, "parts": gathered})
    strategy.close()


def _us(values: list[float]) -> str:
    v = sorted(values)
    return f"median {statistics.median(v) * 1e6:.0f} us (range {v[0] * 1e6:.0f}-{v[-1] * 1e6:.0f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=10, help="rounds of one block of 20 steps per kind (default 10)")
    parser.add_argument("--warmup", type=int, default=20, help="warm-up steps, in blocks of 20 (default 20)")
    args = parser.parse_args()
    from stratagem.bench.multi_process import spawn_ranks

    r = spawn_ranks(_rank, 2, "PORT", args.blocks, args.warmup)
    steps = r["step_s"]
    medians = {k: statistics.median(v) for k, v in steps.items()}
    for k in KINDS:
        print(
            f"step, {k}: median {medians[k] * 1e3:.1f} ms (range {min(steps[k]) * 1e3:.1f}-{max(steps[k]) * 1e3:.1f})"
        )
    for k in ("shipped", "alone"):
        ratios = sorted(a / b for a, b in zip(steps[k], steps["none"]))
        print(
            f"{k} / none, per round: median {statistics.median(ratios):.3f} "
            f"(range {ratios[0]:.3f}-{ratios[-1]:.3f}) over {len(ratios)} rounds"
        )

    def slower(kind: str, name: str) -> list[float]:
        return max((rank_parts[kind][name] for rank_parts, _ in r["parts"]), key=statistics.median)

    for clock in ("", " cpu"):
        own = 0.0
        for name in ("fingerprint", "slots", "compare", "copies"):
            own += statistics.median(slower("shipped", name + clock))
            print(f"the check's {name}{clock} (the slower rank): {_us(slower('shipped', name + clock))} a step")
        if clock:
            step_cpu = max((cpu["none"] for _, cpu in r["parts"]), key=statistics.median)
            print(
                f"together {own * 1e6:.0f} us of the training thread's CPU a step, {own / statistics.median(step_cpu):.2%} "
                f"of its CPU time in a step without the check (median {statistics.median(step_cpu) * 1e3:.1f} ms)"
            )
        else:
            print(
                f"together {own * 1e6:.0f} us a step, {own / medians['none']:.2%} of the median step without the check"
            )
    shipped_rs, none_rs = slower("shipped", "reduce-scatters"), slower("none", "reduce-scatters")
    print(f"reduce-scatters a step (the slower rank), shipped: {_us(shipped_rs)}; none: {_us(none_rs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
