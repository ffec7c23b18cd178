"""One record per strategy: everything the command line, `sg.strategy_from_env` and `stratagem bench` know of it.

`STRATEGIES` holds them in the order the command line lists them. ``stratagem train --strategy NAME``,
``stratagem launch --strategy NAME``, ``STRATAGEM_STRATEGY=NAME`` and ``stratagem bench --strategies``
read their choices, which strategies run one process per worker, the default devices and how to build
each strategy from here, and nowhere else. To offer a new strategy, add its record to `STRATEGIES`.

Example:
    >>> record = STRATEGIES["one_device"]
    >>> record.strategy_class.__name__, record.one_process_per_worker, record.max_devices
    ('OneDeviceStrategy', False, 1)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from stratagem import environ
from stratagem.devices import DeviceRegistry
from stratagem.diagnose import PlacementDecision, collect_facts, gpu_unavailable_reason
from stratagem.errors import InputError
from stratagem.strategies.base import Strategy
from stratagem.strategies.central_storage.strategy import CentralStorageStrategy
from stratagem.strategies.mirrored import MirroredStrategy
from stratagem.strategies.model_parallel.strategy import ModelParallelStrategy
from stratagem.strategies.multi_worker.strategy import MultiWorkerMirroredStrategy
from stratagem.strategies.one_device import OneDeviceStrategy
from stratagem.strategies.parameter_server.strategy import ParameterServerStrategy
from stratagem.strategies.sharded.placement import default_devices as sharded_default_devices
from stratagem.strategies.sharded.strategy import ShardedStrategy
from stratagem.strategies.tensor_parallel.strategy import TensorParallelStrategy

DefaultDevices = Callable[[str, DeviceRegistry], tuple[list[str], PlacementDecision]]
"""``(name, registry) -> (devices, decision)``: the devices a strategy runs on when none are named, and why."""

MODEL_PARALLEL_MICRO_BATCHES = 2

# Two logical CPU replicas on a CPU-only machine: the smallest setup that really exercises the
# gradient combination, and more replicas than cores would only oversubscribe them.
DEFAULT_CPU_REPLICAS = 2


@dataclass(frozen=True, kw_only=True)
class StrategyRecord:
    """What the command line, `strategy_from_env` and the benchmark need to know of one strategy.

    Example:
        >>> StrategyRecord(name="solo", strategy_class=OneDeviceStrategy, default_devices=first_device,
        ...                build=lambda devices, registry: OneDeviceStrategy(devices[0], registry=registry)).name
        'solo'
    """

    name: str
    """Its name on the command line (``--strategy NAME``, ``STRATAGEM_STRATEGY=NAME``) and in bench results."""
    strategy_class: type[Strategy]
    """The class it builds."""
    default_devices: DefaultDevices
    """The devices it runs on when none are named (``--devices``, ``STRATAGEM_DEVICES``), with the reason."""
    build: Callable[[list[str], DeviceRegistry], Strategy]
    """``build(devices, registry)``: the strategy over these devices, as ``stratagem train`` and
    `strategy_from_env` make it."""
    one_process_per_worker: bool = False
    """Each worker is a process of its own, in a cluster (TF_CONFIG, torchrun's or SLURM's variables, or
    ``stratagem launch --workers N``); False for a strategy that trains in one process."""
    parameter_servers: bool = False
    """It needs parameter-server tasks besides the workers (``--ps``), which hold the optimizer's state."""
    max_devices: int | None = None
    """The most devices it takes (OneDeviceStrategy: 1); None for as many as given."""
    bench_build: Callable[[list[str], Mapping[str, Any]], Strategy] | None = None
    """``bench_build(devices, options)``: the strategy ``stratagem bench`` measures, where ``options`` holds
    ``timeout`` and ``registry`` (in one process) or ``timeout`` and ``cluster`` (one process per worker);
    None keeps the strategy out of the benchmark."""


class StrategyRegistry:
    """Strategy records by name, in the order given; a name given twice is refused.

    Example:
        >>> registry = StrategyRegistry([STRATEGIES["mirrored"]])
        >>> registry.names, "mirrored" in registry
        (('mirrored',), True)
    """

    def __init__(self, records: Iterable[StrategyRecord]) -> None:
        self._records: dict[str, StrategyRecord] = {}
        for record in records:
            if record.name in self._records:
                raise InputError(
                    f"Two strategy records have the same name. Received: name={record.name!r} for "
                    f"{self._records[record.name].strategy_class.__name__} and {record.strategy_class.__name__}. "
                    "Give each record a name of its own."
                )
            self._records[record.name] = record

    @property
    def names(self) -> tuple[str, ...]:
        """Every name, in order: the choices of ``--strategy``."""
        return tuple(self._records)

    def __getitem__(self, name: str) -> StrategyRecord:
        return self._records[name]

    def __contains__(self, name: object) -> bool:
        return name in self._records

    def __iter__(self) -> Iterator[StrategyRecord]:
        return iter(self._records.values())

    def __len__(self) -> int:
        return len(self._records)


def _no_gpu() -> str:
    why = gpu_unavailable_reason(collect_facts(environ.current()))
    return f"no usable GPU: {why.reason}" if why is not None else "no usable GPU"


def _gpus(registry: DeviceRegistry) -> list[str]:
    return [d.name for d in registry.get_logical_devices("cuda")]


def _cpus(registry: DeviceRegistry) -> list[str]:
    return [d.name for d in registry.get_logical_devices("cpu")]


def first_device(name: str, registry: DeviceRegistry) -> tuple[list[str], PlacementDecision]:
    """The first visible GPU, else the CPU."""
    gpus = _gpus(registry)
    if gpus:
        return gpus[:1], PlacementDecision(subject="devices", choice=gpus[0], reason="the first visible GPU")
    cpu = _cpus(registry)[0]
    return [cpu], PlacementDecision(
        subject="devices", choice=cpu, reason=f"{_no_gpu()} So {cpu}, one replica. Choose another with --devices."
    )


def every_gpu_else_cpus(what: str) -> DefaultDevices:
    """Every visible GPU, else `DEFAULT_CPU_REPLICAS` logical CPU devices, each one of ``what`` (replica, stage)."""

    def choose(name: str, registry: DeviceRegistry) -> tuple[list[str], PlacementDecision]:
        gpus = _gpus(registry)
        if gpus:
            reason = f"every visible GPU ({len(gpus)})"
            return gpus, PlacementDecision(subject="devices", choice=", ".join(gpus), reason=reason)
        cpus = _cpus(registry)
        chosen = cpus[:DEFAULT_CPU_REPLICAS]
        reason = (
            f"{_no_gpu()} So {len(chosen)} logical CPU {what}(s) out of the {len(cpus)} logical CPU device(s), "
            f"to train {name} on the CPU. Choose others with --devices."
        )
        return chosen, PlacementDecision(subject="devices", choice=", ".join(chosen), reason=reason)

    return choose


def every_gpu_else_one_cpu(name: str, registry: DeviceRegistry) -> tuple[list[str], PlacementDecision]:
    """Every visible GPU, else one CPU replica: for a strategy of one process per worker."""
    gpus = _gpus(registry)
    if gpus:
        reason = f"every visible GPU ({len(gpus)})"
        return gpus, PlacementDecision(subject="devices", choice=", ".join(gpus), reason=reason)
    cpu = _cpus(registry)[0]
    # One replica per worker process: the workers already share the cores between them.
    reason = f"{_no_gpu()} So one CPU replica per worker process."
    return [cpu], PlacementDecision(subject="devices", choice=cpu, reason=reason)


STRATEGIES = StrategyRegistry(
    [
        StrategyRecord(
            name="mirrored",
            strategy_class=MirroredStrategy,
            default_devices=every_gpu_else_cpus("replica"),
            build=lambda devices, registry: MirroredStrategy(devices, registry=registry),
            bench_build=lambda devices, options: MirroredStrategy(
                devices, timeout=options["timeout"], registry=options.get("registry")
            ),
        ),
        StrategyRecord(
            name="one_device",
            strategy_class=OneDeviceStrategy,
            default_devices=first_device,
            build=lambda devices, registry: OneDeviceStrategy(devices[0], registry=registry),
            max_devices=1,
            bench_build=lambda devices, options: OneDeviceStrategy(
                devices[0], timeout=options["timeout"], registry=options.get("registry")
            ),
        ),
        StrategyRecord(
            name="multi_worker",
            strategy_class=MultiWorkerMirroredStrategy,
            default_devices=every_gpu_else_one_cpu,
            build=lambda devices, registry: MultiWorkerMirroredStrategy(devices, registry=registry),
            one_process_per_worker=True,
            bench_build=lambda devices, options: MultiWorkerMirroredStrategy(
                devices, cluster=options["cluster"], timeout=options["timeout"]
            ),
        ),
        StrategyRecord(
            name="central_storage",
            strategy_class=CentralStorageStrategy,
            default_devices=every_gpu_else_cpus("replica"),
            build=lambda devices, registry: CentralStorageStrategy(devices, registry=registry),
            bench_build=lambda devices, options: CentralStorageStrategy(
                devices, timeout=options["timeout"], registry=options.get("registry")
            ),
        ),
        StrategyRecord(
            name="model_parallel",
            strategy_class=ModelParallelStrategy,
            default_devices=every_gpu_else_cpus("stage"),
            # Two micro-batches per global batch, so the stages really work at the same time (GPipe).
            build=lambda devices, registry: ModelParallelStrategy(
                stages=devices, num_micro_batches=MODEL_PARALLEL_MICRO_BATCHES, registry=registry
            ),
        ),
        StrategyRecord(
            name="parameter_server",
            strategy_class=ParameterServerStrategy,
            default_devices=every_gpu_else_one_cpu,
            # The cluster (chief, workers, parameter servers) comes from TF_CONFIG, as `stratagem launch --ps` sets it.
            build=lambda devices, registry: ParameterServerStrategy(),
            one_process_per_worker=True,
            parameter_servers=True,
        ),
        StrategyRecord(
            name="sharded",
            strategy_class=ShardedStrategy,
            # The GPU of this worker's local rank (not the first GPU, which every local rank would share).
            default_devices=sharded_default_devices,
            # One device per worker process: the parameters, gradients and optimizer state are cut across them.
            build=lambda devices, registry: ShardedStrategy(device=devices[0]),
            one_process_per_worker=True,
            max_devices=1,
            bench_build=lambda devices, options: ShardedStrategy(
                device=devices[0], cluster=options["cluster"], timeout=options["timeout"]
            ),
        ),
        StrategyRecord(
            name="tensor_parallel",
            strategy_class=TensorParallelStrategy,
            default_devices=sharded_default_devices,  # one device per worker process, as sharded's
            # By name alone every parameter is replicated: the layouts come from sg.strategy_from_env(layout_map=...).
            build=lambda devices, registry: TensorParallelStrategy(device=devices[0]),
            one_process_per_worker=True,
            max_devices=1,
        ),
    ]
)
"""Every strategy that can be chosen by name, in the order the command line lists them."""
