"""One measurement of `stratagem bench`, run inside a freshly spawned process (one per replica for
strategies whose replicas are processes), so no thread setting or allocator state leaks from one
configuration into the next.

`measure_rank` is the target `stratagem.bench.multi_process.spawn_ranks` starts: rank 0 puts a
`Measurement` (as a dict) on the queue; a rank that fails writes why into `error_dir/rank<N>.txt`
and exits with status 1, so the parent can say what went wrong instead of only an exit code.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from stratagem.bench.peak_memory import PeakMemory
from stratagem.bench.registry import (
    BENCH_STRATEGIES,
    BenchStrategy,
    process_device,
    replica_devices,
)
from stratagem.bench.throughput import (
    Measurement,
    make_train_step,
    measure_plain,
    strategy_steps,
    timed_steps,
)
from stratagem.bench.workloads import WORKLOADS, Workload


@dataclass(frozen=True, kw_only=True)
class MeasureRequest:
    """One configuration to time: a strategy (None for plain PyTorch) on N replicas of a device kind."""

    strategy: str | None
    kind: str
    replicas: int
    workload: str
    warmup: int
    steps: int
    timeout_s: float

    @property
    def label(self) -> str:
        return "plain" if self.strategy is None else f"{self.strategy} x{self.replicas}"


def error_file(error_dir: str | Path, rank: int) -> Path:
    """Where rank `rank` writes why it failed."""
    return Path(error_dir) / f"rank{rank}.txt"


def measure_rank(rank: int, request: MeasureRequest, ports: Sequence[int], error_dir: str, queue: Any) -> None:
    """Runs the measurement of `request` as rank `rank`; rank 0 puts the result on `queue`."""
    try:
        result = _measure(rank, request, ports)
    except BaseException as error:  # noqa: BLE001 - any failure becomes the reason shown in the table
        error_file(error_dir, rank).write_text(f"{type(error).__name__}: {error}")
        raise SystemExit(1) from None
    if rank == 0:
        queue.put(asdict(result))


def _measure(rank: int, request: MeasureRequest, ports: Sequence[int]) -> Measurement:
    workload = WORKLOADS[request.workload]
    if request.strategy is None:
        if request.kind == "cpu":
            memory = PeakMemory.start("cpu")
            result = measure_plain(workload, request.warmup, request.steps)
            return dataclasses.replace(result, peak_memory_bytes=memory.peak())
        return _measure_plain_gpu(workload, request)
    spec = BENCH_STRATEGIES[request.strategy]
    if spec.one_process_per_replica:
        return _measure_process_rank(spec, rank, workload, request, ports)
    return _measure_in_process(spec, workload, request)


def _measure_plain_gpu(workload: Workload, request: MeasureRequest) -> Measurement:
    device = torch.device("cuda:0")
    memory = PeakMemory.start("gpu", "cuda:0")
    model = workload.build_model().to(device)
    optimizer = workload.build_optimizer(model)
    batches = [(x.to(device), y.to(device)) for x, y in workload.make_batches()]
    train_step = make_train_step(model, optimizer)
    elapsed, loss = timed_steps(
        lambda i: train_step(*batches[i % len(batches)]), request.warmup, request.steps, barrier=_cuda_synchronizer(1)
    )
    return _result(request, workload, elapsed, float(loss.detach()), memory.peak())


def _measure_in_process(spec: BenchStrategy, workload: Workload, request: MeasureRequest) -> Measurement:
    options: dict[str, Any] = {"timeout": _wait_timeout(request)}
    if request.kind == "cpu":
        options["registry"] = _cpu_registry(request.replicas)
    strategy = spec.build(replica_devices(request.kind, request.replicas), options)
    try:
        # Every replica's memory is this one process's (on GPUs, the largest device's).
        devices = replica_devices(request.kind, request.replicas) if request.kind == "gpu" else ["cpu"]
        memories = [PeakMemory.start(request.kind, device) for device in devices]
        step = strategy_steps(strategy, workload)
        barrier = _cuda_synchronizer(request.replicas) if request.kind == "gpu" else None
        elapsed, loss = timed_steps(step, request.warmup, request.steps, barrier=barrier)
        final_loss = float(strategy.reduce("mean", loss))
        peaks = [peak for memory in memories if (peak := memory.peak()) is not None]
    finally:
        strategy.close()
    return _result(request, workload, elapsed, final_loss, max(peaks) if peaks else None)


def _measure_process_rank(
    spec: BenchStrategy, rank: int, workload: Workload, request: MeasureRequest, ports: Sequence[int]
) -> Measurement:
    import torch.distributed as dist

    world = request.replicas
    if request.kind == "cpu":
        # The processes share the cores: each gets its share of intra-op threads, as DDP users set it.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cluster = {
        "cluster": {"worker": [f"127.0.0.1:{port}" for port in ports[:world]]},
        "task": {"type": "worker", "index": rank},
    }
    strategy = spec.build(
        [process_device(request.kind, rank)],
        {"timeout": _wait_timeout(request), "cluster": cluster},
    )
    try:
        memory = PeakMemory.start(request.kind, process_device(request.kind, rank))
        step = strategy_steps(strategy, workload)
        sync = _cuda_synchronizer(1, first=rank) if request.kind == "gpu" else None

        def barrier() -> None:
            # The clock starts and stops when every rank is there, so the figure is the slowest rank's.
            if sync is not None:
                sync()
            dist.barrier()

        elapsed, loss = timed_steps(step, request.warmup, request.steps, barrier=barrier)
        final_loss = float(strategy.reduce("mean", loss))
        peak = _largest_across_ranks(memory.peak(), process_device(request.kind, rank))
    finally:
        strategy.close()
    return _result(request, workload, elapsed, final_loss, peak)


def _largest_across_ranks(peak: int | None, device: str) -> int | None:
    """The largest rank's peak (-1 stands for a rank that could not read its own)."""
    import torch.distributed as dist

    value = torch.tensor([-1 if peak is None else peak], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return None if int(value) < 0 else int(value)


def _wait_timeout(request: MeasureRequest) -> float:
    # Half the configuration's budget per wait: a rank left waiting for a dead peer then has time to
    # write the error naming it before the parent stops the configuration at the full timeout.
    return request.timeout_s / 2


def _result(
    request: MeasureRequest, workload: Workload, elapsed: float, final_loss: float, peak_memory: int | None
) -> Measurement:
    return Measurement(
        request.label,
        workload.name,
        request.replicas,
        request.steps,
        elapsed,
        request.steps * workload.global_batch / elapsed,
        final_loss,
        torch.get_num_threads(),
        peak_memory,
    )


def _cuda_synchronizer(count: int, first: int = 0) -> Callable[[], None]:
    # CUDA kernels run asynchronously: the clock may only read once the devices are done.
    def synchronize() -> None:
        for index in range(first, first + count):
            torch.cuda.synchronize(index)

    return synchronize


def _cpu_registry(replicas: int):
    from stratagem.devices import DeviceRegistry

    registry = DeviceRegistry()
    registry.set_logical_device_configuration("cpu", max(replicas, os.cpu_count() or 1))
    return registry
