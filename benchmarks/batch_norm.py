"""What BatchNorm over the global batch costs: batch_norm="global" against batch_norm="per_replica" on 2
replicas, on the reference 3-BatchNorm CNN (batch 64 of 3x32x32) or a ResNet-18 (torchvision's layout,
20 BatchNorm layers, width 64, batch 64 of 3x32x32, SGD with momentum).

    .venv/bin/python benchmarks/batch_norm.py                               # CNN, Mirrored x2, 5 blocks of 20 steps
    .venv/bin/python benchmarks/batch_norm.py --model resnet18 --steps 4 --blocks 8 --breakdown
    .venv/bin/python benchmarks/batch_norm.py --strategy multi_worker --model resnet18 --steps 4 --blocks 6
    .venv/bin/python benchmarks/batch_norm.py --model resnet18 --function-cost --against /tmp/before.py
    .venv/bin/python benchmarks/batch_norm.py --model resnet18 --arrivals --steps 12
    .venv/bin/python benchmarks/batch_norm.py --model resnet18 --python-meetings --steps 5 --blocks 8

Mirrored x2: the two settings run in one process, in alternating blocks (per-replica first in odd
blocks), so a disturbance from other work on a shared machine hits both; prints each side's median
ms/step and the median of the per-block ratios global / per-replica. --breakdown also times, in the
global side's blocks, each replica's time inside the BatchNorm meetings (arrival to return: waiting
for the slower replica and the sum). It also prints the process's CPU time per step of each side: the
work exactness adds, apart from waiting.

--against FILE (Mirrored x2): both sides use batch_norm="global", one with this tree's GlobalBatchNormFunction,
the other (printed as per_replica) with the one defined in FILE, e.g. an earlier commit's
`git show <commit>:src/stratagem/strategies/data_parallel/batch_norm_function.py > /tmp/before.py`: before
and after in the same process, alternating blocks.

--python-meetings (Mirrored x2): both sides use batch_norm="global", one with the native meetings (C++,
batch_norm_native.py: the default on a CPU), the other (printed as per_replica) with the Python meetings and
this tree's GlobalBatchNormFunction: what the native meetings save, in the same process.

--function-cost: the autograd function alone over the model's BatchNorm shapes (half the batch each), on two
threads that meet at the strategy's ReplicaBarrier as two replicas do, against plain training-mode
`F.batch_norm` on the same threads without meetings, and against FILE's function with --against: the CPU
time of both threads per pass (forward and backward of every layer; alternating repeats) and the number of
operations torch dispatches per replica and layer (deterministic, unlike times on a shared machine).

--arrivals (Mirrored x2, exact BatchNorm only): when each replica reaches each meeting over --steps steps, the
meetings where they are furthest apart, and each replica thread's minor page faults per step; a meeting one
replica reaches late in every step points at work only that replica does before it.

MultiWorkerMirrored x2 (2 processes, one replica each): one process holds one MultiWorkerMirroredStrategy,
so the two settings cannot share processes. Each run holds the strategy (one setting) and a
DistributedDataParallel model (per-replica statistics: torch's SyncBatchNorm has no CPU kernel) in the
same two processes, in alternating blocks; the runs of the two settings alternate, and the ratio of
their MWMS / DDP medians is global / per-replica with the noise of each run divided out by its DDP.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 64, bias=False),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + (x if self.down is None else self.down(x)))


def resnet18(width: int = 64) -> nn.Module:
    """torchvision's resnet18 layout (7x7 stem, max-pool, 4 stages of 2 basic blocks), 10 classes."""
    torch.manual_seed(0)
    widths = [width, 2 * width, 4 * width, 8 * width]
    layers: list[nn.Module] = [
        nn.Conv2d(3, width, 7, 2, 3, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = width
    for stage, cout in enumerate(widths):
        layers += [_Block(cin, cout, 1 if stage == 0 else 2), _Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers)


MODELS: dict[str, Callable[[], nn.Module]] = {"cnn": cnn, "resnet18": resnet18}


def make_data() -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(4)]


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


# ---- Mirrored x2, one process ------------------------------------------------------------------------------
class MeetingClock:
    """Times each replica's calls of BatchNormSync.meet while `on` (the benchmark's own instrumentation), split
    into waiting for the last replica to arrive, the combination the last one runs for all (sums, and across
    workers), and the wake-up after it (from the end of the combination until the replica runs again: the
    operating system and Python's global lock handing it back)."""

    PARTS = ("waiting for the last replica", "combination", "wake-up")

    def __init__(self) -> None:
        from stratagem.strategies.data_parallel.batch_norm import BatchNormSync

        self.on = False
        self.ns: dict[int, dict[str, int]] = {}
        original = BatchNormSync.meet
        clock = self
        combined: list[int] = [0, 0]  # start and end of the running meeting's combination

        def meet(sync, replica, contribution, what, combine):  # type: ignore[no-untyped-def]
            if not clock.on:
                return original(sync, replica, contribution, what, combine)

            def timed(contributions, step):  # type: ignore[no-untyped-def]
                combined[0] = time.perf_counter_ns()
                try:
                    return combine(contributions, step)
                finally:
                    combined[1] = time.perf_counter_ns()

            arrived = time.perf_counter_ns()
            result = original(sync, replica, contribution, what, timed)
            done = time.perf_counter_ns()
            mine = clock.ns.setdefault(replica, dict.fromkeys(clock.PARTS, 0))
            mine["waiting for the last replica"] += max(0, combined[0] - arrived)
            mine["combination"] += combined[1] - combined[0]
            mine["wake-up"] += done - combined[1]
            return result

        BatchNormSync.meet = meet  # type: ignore[method-assign]

    def slowest(self) -> dict[str, int]:
        """The parts of the replica that spent the longest inside meetings."""
        return max(self.ns.values(), key=lambda parts: sum(parts.values()))


class NativeClock:
    """The native meetings' own times (batch_norm_native.cpp records, in the steps it is told to time, each local
    replica's time from arrival to return: waiting for the last replica, the sum, the wake-up), every step while
    `on`, summed per replica until `take`."""

    def __init__(self) -> None:
        from stratagem.strategies.data_parallel.cpu_threads.batch_norm_native import NativeMeetings

        self.on = False
        self.ns: list[int] = []
        original = NativeMeetings.begin_step
        clock = self

        def begin_step(native, step, timed):  # type: ignore[no-untyped-def]
            if not clock.on:
                return original(native, step, timed)
            clock.collect(native)
            native.meeting.reset(True)

        NativeMeetings.begin_step = begin_step  # type: ignore[method-assign]

    def collect(self, native) -> None:  # type: ignore[no-untyped-def]
        _, spent, _ = native.meeting.times()
        self.ns = [a + b for a, b in zip(self.ns, spent)] if self.ns else list(spent)

    def take(self, native) -> int:  # type: ignore[no-untyped-def]
        """The slower replica's ns inside the meetings since the last `take` (the running step's included)."""
        self.collect(native)
        native.meeting.reset(True)
        slowest, self.ns = max(self.ns, default=0), []
        return slowest


class ArrivalLog:
    """Records, while `on`, when each replica arrives at each BatchNorm meeting of a step and which OS thread runs
    it (the benchmark's own instrumentation, wrapped around BatchNormSync.meet)."""

    def __init__(self) -> None:
        import threading

        from stratagem.strategies.data_parallel.batch_norm import BatchNormSync

        self.on = False
        self.arrivals: dict[tuple[int, int], int] = {}  # (replica, meeting) -> ns
        self.names: dict[int, str] = {}  # meeting -> what
        self.threads: dict[int, int] = {}  # replica -> native thread id
        original = BatchNormSync.meet
        log = self

        def meet(sync, replica, contribution, what, combine):  # type: ignore[no-untyped-def]
            if log.on:
                meeting = sync._exchanges[replica]
                log.arrivals[(replica, meeting)] = time.perf_counter_ns()
                log.names[meeting] = what
                log.threads[replica] = threading.get_native_id()
            return original(sync, replica, contribution, what, combine)

        BatchNormSync.meet = meet  # type: ignore[method-assign]


def minor_faults(tid: int) -> int:
    """The minor page faults of one thread of this process so far (Linux)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def arrivals(args: argparse.Namespace) -> None:
    """--arrivals: how far apart the two replicas reach each meeting, per meeting over `steps` steps, and each
    replica thread's page faults per step: a meeting where one replica is late in every step points at work
    only that replica does before it."""
    log = ArrivalLog()
    strategy, step, batches = mirrored_side(args.model, "global", make_data())
    for i in range(3):
        strategy.run(step, args=batches[i % len(batches)])
    lags: dict[int, list[float]] = {}
    per_step: list[float] = []
    faults_before: dict[int, int] = {}
    for i in range(args.steps):
        log.on, log.arrivals = True, {}
        if i == 1:  # the threads are known after a step
            faults_before = {r: minor_faults(tid) for r, tid in log.threads.items()}
        strategy.run(step, args=batches[i % len(batches)])
        log.on = False
        meetings = sorted({m for _, m in log.arrivals})
        step_lags = [(log.arrivals[(1, m)] - log.arrivals[(0, m)]) / 1e6 for m in meetings]
        for m, lag in zip(meetings, step_lags):
            lags.setdefault(m, []).append(lag)
        per_step.append(sum(abs(lag) for lag in step_lags))
    faults = {r: (minor_faults(tid) - faults_before[r]) / (args.steps - 1) for r, tid in log.threads.items()}
    print(
        f"{args.model}, Mirrored x2, batch_norm='global', {args.steps} steps: the replicas reach the {len(lags)} "
        f"meetings a median {statistics.median(per_step):.1f} ms/step apart in all (sum of the differences; "
        f"steps: {', '.join(f'{v:.1f}' for v in per_step)})"
    )
    print(
        "minor page faults per step: "
        + ", ".join(f"replica {r} {faults[r]:.0f}" for r in sorted(faults))
        + " (replica 0 runs on the caller's thread)"
    )
    worst = sorted(lags, key=lambda m: -abs(statistics.median(lags[m])))[:5]
    print("the meetings with the largest median difference (replica 1 arrival - replica 0 arrival, ms):")
    for m in worst:
        print(
            f"  meeting {m} ({log.names[m]}): median {statistics.median(lags[m]):+.2f} "
            f"(steps: {', '.join(f'{v:+.1f}' for v in lags[m])})"
        )
    strategy.close()


def mirrored_side(model_name: str, mode: str, data: list) -> tuple:
    import stratagem as sg
    from stratagem.devices import DeviceRegistry

    registry = DeviceRegistry()
    registry.set_logical_device_configuration("cpu", 2)
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=registry, batch_norm=mode)
    model = MODELS[model_name]()
    model, optimizer = strategy.distribute(model, optimizer_for(model))

    def step(x, y):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    batches = list(strategy.distribute_dataset(data))
    strategy.run(step, args=batches[0])  # warm-up
    return strategy, step, batches


def load_function(path: str) -> type:
    """The `GlobalBatchNormFunction` defined in the file at `path` (another version of batch_norm_function.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("batch_norm_function_against", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--against: cannot load {path!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.GlobalBatchNormFunction


def mirrored(args: argparse.Namespace) -> None:
    from stratagem.strategies.data_parallel import batch_norm as bn_module

    clock = MeetingClock() if args.breakdown else None
    native_clock = NativeClock() if args.breakdown else None
    native_ns: list[float] = []
    data = make_data()
    functions = {"global": bn_module.GlobalBatchNormFunction}
    if args.against:  # both sides exact, the "per_replica" side with the other function
        functions["per_replica"] = load_function(args.against)
        print(f"--against: the side printed as per_replica is batch_norm='global' with {args.against}'s function")
    both_exact = bool(args.against or args.python_meetings)
    sides = {
        mode: mirrored_side(args.model, "global" if both_exact else mode, data) for mode in ("global", "per_replica")
    }
    if args.python_meetings:
        sides["per_replica"][0]._replicas._batch_norm.sync._native = None  # this side meets in Python
        print("--python-meetings: the side printed as per_replica is batch_norm='global' with the Python meetings")
    native = sides["global"][0]._replicas._batch_norm.sync._native
    print(f"the global side's meetings run {'in C++' if native is not None else 'in Python'}")
    print(sides["global"][0].explain().details.get("BatchNorm meetings", ""))
    times: dict[str, list[float]] = {mode: [] for mode in sides}
    cpu: dict[str, list[float]] = {mode: [] for mode in sides}
    in_meetings: list[dict[str, float]] = []
    for b in range(args.blocks):
        for mode in ["global", "per_replica"] if b % 2 == 0 else ["per_replica", "global"]:
            strategy, step, batches = sides[mode]
            bn_module.GlobalBatchNormFunction = functions.get(mode, functions["global"])  # type: ignore[misc]
            if clock is not None:
                clock.on, clock.ns = mode == "global", {}
            native = strategy._replicas._batch_norm.sync._native
            timed_natively = native_clock is not None and mode == "global" and native is not None
            if timed_natively:
                native_clock.on = True
                native_clock.take(native)  # from zero
            start, start_cpu = time.perf_counter(), time.process_time()
            for i in range(args.steps):
                strategy.run(step, args=batches[i % len(batches)])
            times[mode].append((time.perf_counter() - start) / args.steps)
            cpu[mode].append((time.process_time() - start_cpu) / args.steps)
            if timed_natively:
                native_ns.append(native_clock.take(native) / 1e9 / args.steps)
                native_clock.on = False
            elif clock is not None and mode == "global" and clock.ns:
                in_meetings.append({k: v / 1e9 / args.steps for k, v in clock.slowest().items()})
    for mode, values in times.items():
        print(
            f"{args.model}, Mirrored x2, batch_norm={mode!r}: median {statistics.median(values) * 1000:.1f} ms/step "
            f"(blocks: {', '.join(f'{v * 1000:.0f}' for v in values)})"
        )
    ratios = [g / p for g, p in zip(times["global"], times["per_replica"])]
    print(
        f"global / per_replica: median ratio {statistics.median(ratios):.3f} over {args.blocks} blocks "
        f"(range {min(ratios):.3f}-{max(ratios):.3f})"
    )
    cpu_ratios = [g / p for g, p in zip(cpu["global"], cpu["per_replica"])]
    print(
        f"CPU time of the process (both replica threads) per step, global / per_replica: median "
        f"{statistics.median(cpu_ratios):.3f} (range {min(cpu_ratios):.3f}-{max(cpu_ratios):.3f}; "
        f"{statistics.median(cpu['global']) * 1000:.1f} and {statistics.median(cpu['per_replica']) * 1000:.1f} ms)"
    )
    if in_meetings:
        totals = [sum(m.values()) for m in in_meetings]
        shares = [m / t for m, t in zip(totals, times["global"])]
        parts = ", ".join(f"{k} {statistics.median(m[k] for m in in_meetings) * 1000:.1f}" for k in MeetingClock.PARTS)
        print(
            f"global: the slower replica spent a median {statistics.median(totals) * 1000:.1f} ms/step inside "
            f"the BatchNorm meetings ({parts} ms/step), {statistics.median(shares):.1%} of the step "
            f"(blocks: {', '.join(f'{s:.1%}' for s in shares)})"
        )
    if native_ns:
        shares = [m / t for m, t in zip(native_ns, times["global"])]
        print(
            f"global: the slower replica spent a median {statistics.median(native_ns) * 1000:.1f} ms/step inside the "
            f"native BatchNorm meetings (arrival to return: waiting for the last replica, the sum, the wake-up), "
            f"{statistics.median(shares):.1%} of the step (blocks: {', '.join(f'{s:.1%}' for s in shares)})"
        )
    for strategy, _, _ in sides.values():
        strategy.close()


# ---- the autograd function alone, on two threads meeting at the ReplicaBarrier -----------------------------
class TwoReplicaMeeting:
    """What `GlobalBatchNormFunction` asks of `BatchNormSync`, for two replica threads of one process: the same
    two-slot meeting at a `ReplicaBarrier`, weights of 1, no workers."""

    def __init__(self) -> None:
        from stratagem.strategies.data_parallel.replicas import ReplicaBarrier

        self.barrier = ReplicaBarrier(["replica 0", "replica 1"], 120.0)
        self.slots: list[list] = [[None, None], [None, None]]
        self.results: list = [None, None]
        self.count = [0, 0]

    def meet(self, replica, contribution, what, combine):  # type: ignore[no-untyped-def]
        count = self.count[replica]
        self.count[replica] = count + 1
        slots, results = self.slots[count % 2], self.results

        def last() -> None:
            results[count % 2] = combine(list(slots), 0)

        slots[replica] = contribution
        self.barrier.wait(replica, what, 0, last=last)
        return results[count % 2]

    def sum_across_workers(self, total, what, step) -> None:  # type: ignore[no-untyped-def]
        pass  # one process: there are no other workers to sum with

    def layer_name(self, layer: int) -> str:
        return f"layer {layer}"

    def weight_of(self, replica: int) -> float:
        return 1.0

    def step_number(self) -> int:
        return 0


def batch_norm_inputs(model_name: str, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """(x, weight, bias, dy) for each BatchNorm layer of the model, at its input's shape for half the batch."""
    model = MODELS[model_name]()
    shapes: list[tuple[int, ...]] = []
    hooks = [
        m.register_forward_hook(lambda m, i, o: shapes.append(tuple(i[0].shape)))
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]
    with torch.no_grad():
        model(torch.randn(32, 3, 32, 32))
    for hook in hooks:
        hook.remove()
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(*shape, generator=g).requires_grad_(),
            torch.rand(shape[1], generator=g).add_(0.5).requires_grad_(),
            torch.randn(shape[1], generator=g).requires_grad_(),
            torch.randn(*shape, generator=g),
        )
        for shape in shapes
    ]


def function_cost(args: argparse.Namespace) -> None:
    import threading

    from torch.utils._python_dispatch import TorchDispatchMode

    from stratagem.strategies.data_parallel.batch_norm_function import Call, GlobalBatchNormFunction

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops += 1
            return func(*args, **(kwargs or {}))

    functions: dict[str, type | None] = {"plain F.batch_norm": None, "this tree": GlobalBatchNormFunction}
    if args.against:
        functions[args.against] = load_function(args.against)
    inputs = [batch_norm_inputs(args.model, seed) for seed in (0, 1)]
    layers = len(inputs[0])

    def replica(function, sync, r, passes, cpu, ops) -> None:  # type: ignore[no-untyped-def]
        torch.set_num_threads(1)
        counter = Count() if ops is not None else None
        start = time.thread_time()
        for _ in range(passes):
            for x, w, b, dy in inputs[r]:
                running_mean, running_var = torch.zeros(x.shape[1]), torch.ones(x.shape[1])
                if counter is not None:
                    counter.__enter__()
                if function is None:
                    y = F.batch_norm(x, running_mean, running_var, w, b, True, 0.1, 1e-5)
                else:
                    y = function.apply(x, w, b, Call(sync, 0, r, False, 1e-5), running_mean, running_var, 0.1)
                y.backward(dy)
                if counter is not None:
                    counter.__exit__(None, None, None)
        cpu[r] = (time.thread_time() - start) / passes
        if counter is not None:
            ops[r] = counter.ops

    def run(function, passes: int, count: bool) -> tuple[float, float]:  # type: ignore[no-untyped-def]
        sync = TwoReplicaMeeting()
        cpu, ops = [0.0, 0.0], ([0, 0] if count else None)
        threads = [threading.Thread(target=replica, args=(function, sync, r, passes, cpu, ops)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(cpu), (sum(ops) / 2 / layers if ops is not None else 0.0)

    counts = {name: run(function, 1, True)[1] for name, function in functions.items()}
    cpu: dict[str, list[float]] = {name: [] for name in functions}
    for repeat in range(args.blocks):
        order = list(functions.items())
        for name, function in order if repeat % 2 == 0 else reversed(order):
            cpu[name].append(run(function, args.steps, False)[0])
    for name, values in cpu.items():
        print(
            f"{args.model}, {layers} BatchNorm layers, {name}: CPU of both threads per pass (forward and backward "
            f"of every layer) median {statistics.median(values) * 1000:.1f} ms (range {min(values) * 1000:.1f}-"
            f"{max(values) * 1000:.1f}); {counts[name]:.1f} dispatched operations per replica and layer"
        )


# ---- MultiWorkerMirrored x2, two processes ---------------------------------------------------------------
def _rank(rank: int, model_name: str, mode: str, port: int, blocks: int, steps: int, queue) -> None:
    import torch.distributed as dist

    import stratagem as sg

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    cluster = {
        "cluster": {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]},
        "task": {"type": "worker", "index": rank},
    }
    strategy = sg.MultiWorkerMirroredStrategy(["cpu:0"], cluster=cluster, timeout=300, batch_norm=mode)
    data = make_data()
    model = MODELS[model_name]()
    model, opt = strategy.distribute(model, optimizer_for(model))

    def mwms_step(x, y):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    batches = [b for b in strategy.distribute_dataset(data)]
    ddp = torch.nn.parallel.DistributedDataParallel(MODELS[model_name]())
    ddp_opt = optimizer_for(ddp)
    local = [(x[rank * 32 : (rank + 1) * 32], y[rank * 32 : (rank + 1) * 32]) for x, y in data]

    def ddp_step(x, y):
        F.cross_entropy(ddp(x), y).backward()
        ddp_opt.step()
        ddp_opt.zero_grad()

    sides = {
        "mwms": lambda i: strategy.run(mwms_step, args=batches[i % len(batches)]),
        "ddp": lambda i: ddp_step(*local[i % len(local)]),
    }
    for run in sides.values():
        run(0)
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for block in range(blocks):
        for name in ["mwms", "ddp"] if block % 2 == 0 else ["ddp", "mwms"]:
            dist.barrier()
            start = time.perf_counter()
            for i in range(steps):
                sides[name](i)
            dist.barrier()
            seconds[name].append((time.perf_counter() - start) / steps)
    if rank == 0:
        queue.put(
            {
                "mode": mode,
                "seconds": seconds,
                "ratios": [m / d for m, d in zip(seconds["mwms"], seconds["ddp"])],
                "meetings": strategy.explain().details.get("BatchNorm meetings", ""),
            }
        )
    sides.clear()
    ddp = None  # DDP (and its reducer) gone before the group closes
    strategy.close()


def multi_worker(args: argparse.Namespace) -> None:
    from stratagem.bench.multi_process import spawn_ranks

    results: dict[str, list[float]] = {"global": [], "per_replica": []}
    for round_ in range(args.rounds):
        for mode in ["global", "per_replica"] if round_ % 2 == 0 else ["per_replica", "global"]:
            r = spawn_ranks(_rank, 2, args.model, mode, "PORT", args.blocks, args.steps)
            ms = {n: statistics.median(v) * 1000 for n, v in r["seconds"].items()}
            print(
                f"{args.model}, round {round_ + 1}, MultiWorkerMirrored x2 batch_norm={mode!r}: "
                f"{ms['mwms']:.0f} ms/step, DDP x2 {ms['ddp']:.0f} ms/step, MWMS / DDP median "
                f"{statistics.median(r['ratios']):.3f} (blocks: {', '.join(f'{x:.2f}' for x in r['ratios'])})"
            )
            if r["meetings"]:
                print(f"  explain(): {r['meetings']}")
            results[mode] += r["ratios"]
    g, p = statistics.median(results["global"]), statistics.median(results["per_replica"])
    print(
        f"global / per_replica (each against DDP in its own processes): {g / p:.3f} "
        f"(MWMS / DDP medians {g:.3f} and {p:.3f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="cnn")
    parser.add_argument("--strategy", choices=("mirrored", "multi_worker"), default="mirrored")
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--rounds", type=int, default=2, help="multi_worker: runs of each setting, alternating")
    parser.add_argument("--breakdown", action="store_true", help="mirrored: time inside the BatchNorm meetings")
    parser.add_argument("--against", help="mirrored: the GlobalBatchNormFunction of this file on the other side")
    parser.add_argument("--function-cost", action="store_true", help="the autograd function alone, two threads")
    parser.add_argument("--arrivals", action="store_true", help="mirrored: when each replica reaches each meeting")
    parser.add_argument(
        "--python-meetings", action="store_true", help="mirrored: the native meetings against the Python ones"
    )
    args = parser.parse_args()
    if args.function_cost:
        function_cost(args)
    elif args.arrivals:
        arrivals(args)
    else:
        (mirrored if args.strategy == "mirrored" else multi_worker)(args)


if __name__ == "__main__":
    main()
