"""The strategies `stratagem bench` knows how to measure, taken from the strategies' records.

A strategy joins the benchmark through its `StrategyRecord` (`stratagem.strategies.records`): a
``bench_build`` saying how to build it on a list of devices; whether its replicas are threads of one
process or one process each, and the most devices it takes, are the record's too.

Example:
    >>> spec = BENCH_STRATEGIES["mirrored"]
    >>> spec.unavailable_reason("cpu", 2, BenchMachine(cpu_devices=2)) is None
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stratagem.errors import InputError
from stratagem.strategies import Strategy
from stratagem.strategies.records import STRATEGIES, StrategyRecord

DEVICE_KINDS = ("cpu", "gpu")
MIN_CPU_WORKERS = 3
"""Worker processes on the CPU share its cores, as threads do, and may number up to its logical devices or this
many, whichever is more: memory per rank against worker count needs three points even on a 2-core machine."""


@dataclass(frozen=True, kw_only=True)
class BenchMachine:
    """What the benchmark can place replicas on: logical CPU devices and CUDA GPUs.

    Example:
        >>> BenchMachine(cpu_devices=2, gpu_devices=0).max_replicas("gpu")
        0
    """

    cpu_devices: int
    """Logical CPU devices of the default registry (one per core unless configured otherwise)."""
    gpu_devices: int = 0
    """CUDA GPUs torch can see."""
    gloo: bool = True
    """torch.distributed with the Gloo backend (cross-process collectives on the CPU)."""
    nccl: bool = False
    """torch.distributed with the NCCL backend (cross-process collectives on GPUs)."""
    no_gpu_reason: str | None = None
    """Why no GPU is measured (the `stratagem doctor` diagnosis), when there is none."""

    @classmethod
    def detect(cls) -> BenchMachine:
        """The machine this process runs on."""
        from stratagem import environ
        from stratagem.devices import get_logical_devices
        from stratagem.diagnose import collect_facts, gpu_unavailable_reason

        has_dist = dist.is_available()
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        no_gpu = gpu_unavailable_reason(collect_facts(environ.current())) if gpus == 0 else None
        return cls(
            cpu_devices=len(get_logical_devices("cpu")),
            gpu_devices=gpus,
            gloo=has_dist and dist.is_gloo_available(),
            nccl=has_dist and dist.is_nccl_available(),
            no_gpu_reason=None if no_gpu is None else no_gpu.reason,
        )

    def max_replicas(self, kind: str) -> int:
        """How many replicas of one kind this machine can hold (0 when it has none of that kind)."""
        return self.cpu_devices if kind == "cpu" else self.gpu_devices

    def device_kinds(self) -> tuple[str, ...]:
        """The kinds present: always "cpu", then "gpu" when there is a GPU."""
        return tuple(kind for kind in DEVICE_KINDS if self.max_replicas(kind) > 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cpu_devices": self.cpu_devices,
            "gpu_devices": self.gpu_devices,
            "gloo": self.gloo,
            "nccl": self.nccl,
            "no_gpu_reason": self.no_gpu_reason,
        }


def replica_devices(kind: str, replicas: int) -> list[str]:
    """The device names N in-process replicas of a kind run on (`cpu:0, cpu:1, ...` or `cuda:0, ...`)."""
    prefix = "cpu" if kind == "cpu" else "cuda"
    return [f"{prefix}:{i}" for i in range(replicas)]


def process_device(kind: str, rank: int) -> str:
    """The one device of rank `rank` when each replica is a process: the CPU, or that rank's GPU."""
    return "cpu:0" if kind == "cpu" else f"cuda:{rank}"


@dataclass(frozen=True, kw_only=True)
class BenchStrategy:
    """How to build and run one strategy in the benchmark: its record's (`strategies.records`) view of it."""

    name: str
    """Its name on the command line and in the results."""
    build: Callable[[list[str], Mapping[str, Any]], Strategy]
    """`build(devices, options)` returns the strategy; `options` holds `timeout` and `registry`
    (in-process) or `timeout` and `cluster` (one process per replica)."""
    one_process_per_replica: bool = False
    """Each replica is its own process (collectives through torch.distributed) instead of a thread."""
    max_replicas: int | None = None
    """A fixed limit of the strategy itself (OneDeviceStrategy: 1); None for as many as the devices. A strategy of
    one process per replica has none: its record's `max_devices` caps each worker's devices, and the benchmark
    gives each of its processes one device whatever the number of replicas."""

    @classmethod
    def from_record(cls, record: StrategyRecord) -> BenchStrategy:
        """The benchmark's entry for a strategy whose record says how bench builds it."""
        if record.bench_build is None:
            raise InputError(
                f"The strategy has no benchmark build. Received: {record.name!r} with bench_build=None. "
                "Give its StrategyRecord a bench_build, or leave it out of the benchmark."
            )
        return cls(
            name=record.name,
            build=record.bench_build,
            one_process_per_replica=record.one_process_per_worker,
            # ShardedStrategy's max_devices=1 is per worker: sharded x2 is two processes of one device each.
            max_replicas=None if record.one_process_per_worker else record.max_devices,
        )

    def unavailable_reason(self, kind: str, replicas: int, machine: BenchMachine) -> str | None:
        """Why this strategy cannot run `replicas` replicas of `kind` here, or None when it can."""
        if self.max_replicas is not None and replicas > self.max_replicas:
            return f"{self.name} runs at most {self.max_replicas} replica(s)"
        have = machine.max_replicas(kind)
        if self.one_process_per_replica and kind == "cpu":  # each worker runs on cpu:0, sharing the cores
            have = max(have, MIN_CPU_WORKERS)
        if replicas > have:
            unit = "logical CPU device(s)" if kind == "cpu" else "GPU(s)"
            return f"this machine has {have} {unit}, fewer than {replicas} replicas"
        if self.one_process_per_replica:
            backend, present = ("gloo", machine.gloo) if kind == "cpu" else ("nccl", machine.nccl)
            if not present:
                return f"torch.distributed has no {backend} backend in this torch build"
        return None


BENCH_STRATEGIES: dict[str, BenchStrategy] = {
    record.name: BenchStrategy.from_record(record) for record in STRATEGIES if record.bench_build is not None
}
"""Every strategy whose record says how `stratagem bench` builds it, in the records' order."""
