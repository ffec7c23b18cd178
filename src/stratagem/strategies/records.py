"""One record per strategy: everything the command line, `sg.strategy_from_env` and `stratagem bench` know of it.

`STRATEGIES` holds them in the order the command line lists them, and it is the one list of strategies:
``stratagem train --strategy NAME``, ``stratagem launch --strategy NAME`` (and the launcher's table of which
strategies run one process per worker), ``STRATAGEM_STRATEGY=NAME``, ``stratagem bench --strategies`` and the
lazy exports of `stratagem` and `stratagem.strategies` read their choices, the default devices and how to build
each strategy from here, and nowhere else. To offer a new strategy, add its record to `STRATEGIES`.

A strategy of one process per worker is its record plus its ordered list of techniques, which the record names
(`techniques_path`, imported by `techniques` when first used): MultiWorkerMirrored replicates along `data`,
Sharded shards along `data`, TensorParallel splits along `model`, then shards and replicates along `data`
(`worker_group/techniques.py`).

This module imports neither torch nor any strategy when it is read (`stratagem launch` and `import stratagem`
read it): a record names its class by module path, and its class, its default devices and its builders import
what they need when called, so the first use of one strategy imports that strategy only.

Example:
    >>> record = STRATEGIES["one_device"]
    >>> record.class_name, record.one_process_per_worker, record.max_devices
    ('OneDeviceStrategy', False, 1)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stratagem.errors import InputError

if TYPE_CHECKING:
    from stratagem.devices import DeviceRegistry
    from stratagem.diagnose import PlacementDecision
    from stratagem.strategies.base import Strategy
    from stratagem.strategies.worker_group.techniques import Technique

DefaultDevices = Callable[[str, "DeviceRegistry"], tuple[list[str], "PlacementDecision"]]
"""``(name, registry) -> (devices, decision)``: the devices a strategy runs on when none are named, and why."""

MODEL_PARALLEL_MICRO_BATCHES = 2

# Two logical CPU replicas on a CPU-only machine: the smallest setup that really exercises the
# gradient combination, and more replicas than cores would only oversubscribe them.
DEFAULT_CPU_REPLICAS = 2


@dataclass(frozen=True, kw_only=True)
class StrategyRecord:
    """What the command line, `strategy_from_env` and the benchmark need to know of one strategy.

    Example:
        >>> StrategyRecord(name="solo", strategy_path="stratagem.strategies.one_device:OneDeviceStrategy",
        ...                default_devices=first_device, build=lambda devices, registry: ...).class_name
        'OneDeviceStrategy'
    """

    name: str
    """Its name on the command line (``--strategy NAME``, ``STRATAGEM_STRATEGY=NAME``) and in bench results."""
    strategy_path: str
    """``"module:ClassName"``, the class it builds, imported when first used (`strategy_class`); the class is
    exported under its own name as ``sg.ClassName`` and ``stratagem.strategies.ClassName``."""
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
    techniques_path: str | None = None
    """``"module:NAME"`` of the ordered tuple of `Technique` its `distribute` applies (`worker_group/techniques.py`),
    imported when first used (`techniques`); None for a strategy not built of techniques."""

    def __post_init__(self) -> None:
        paths = [("strategy_path", "class", "ClassName", "the class", self.strategy_path)]
        if self.techniques_path is not None:
            paths.append(("techniques_path", "techniques", "NAME", "the tuple's name", self.techniques_path))
        for field_name, what, shape, ending, path in paths:
            module, _, attribute = path.partition(":")
            if not (module.startswith("stratagem.") and attribute.isidentifier()):
                raise InputError(
                    f"A strategy record names its {what} as 'stratagem.module.path:{shape}'. Received: "
                    f"{field_name}={path!r} for {self.name!r}. Write the module, a colon and {ending}."
                )

    @property
    def module(self) -> str:
        """The module that defines the class (imported by `strategy_class`, not before)."""
        return self.strategy_path.partition(":")[0]

    @property
    def class_name(self) -> str:
        """The class's name: ``sg.<class_name>`` is the class."""
        return self.strategy_path.partition(":")[2]

    @property
    def strategy_class(self) -> type[Strategy]:
        """The class it builds; imports its module (only that strategy's) the first time."""
        strategy_class: type[Strategy] = getattr(importlib.import_module(self.module), self.class_name)
        return strategy_class

    @property
    def techniques(self) -> tuple[Technique[Any], ...]:
        """The techniques its `distribute` applies, in their order (empty for a strategy not built of techniques);
        imports their module the first time."""
        if self.techniques_path is None:
            return ()
        module, _, name = self.techniques_path.partition(":")
        techniques: tuple[Technique[Any], ...] = tuple(getattr(importlib.import_module(module), name))
        return techniques


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
                    f"{self._records[record.name].class_name} and {record.class_name}. "
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
    from stratagem import environ
    from stratagem.diagnose import collect_facts, gpu_unavailable_reason

    why = gpu_unavailable_reason(collect_facts(environ.current()))
    return f"no usable GPU: {why.reason}" if why is not None else "no usable GPU"


def _devices(choice: str, reason: str) -> PlacementDecision:
    # Imported when a strategy's devices are chosen: diagnose imports torch, which reading the records must not.
    from stratagem.diagnose import PlacementDecision

    return PlacementDecision(subject="devices", choice=choice, reason=reason)


def _gpus(registry: DeviceRegistry) -> list[str]:
    return [d.name for d in registry.get_logical_devices("cuda")]


def _cpus(registry: DeviceRegistry) -> list[str]:
    return [d.name for d in registry.get_logical_devices("cpu")]


def first_device(name: str, registry: DeviceRegistry) -> tuple[list[str], PlacementDecision]:
    """The first visible GPU, else the CPU."""
    gpus = _gpus(registry)
    if gpus:
        return gpus[:1], _devices(gpus[0], "the first visible GPU")
    cpu = _cpus(registry)[0]
    return [cpu], _devices(cpu, f"{_no_gpu()} So {cpu}, one replica. Choose another with --devices.")


def every_gpu_else_cpus(what: str) -> DefaultDevices:
    """Every visible GPU, else `DEFAULT_CPU_REPLICAS` logical CPU devices, each one of ``what`` (replica, stage)."""

    def choose(name: str, registry: DeviceRegistry) -> tuple[list[str], PlacementDecision]:
        gpus = _gpus(registry)
        if gpus:
            return gpus, _devices(", ".join(gpus), f"every visible GPU ({len(gpus)})")
        cpus = _cpus(registry)
        chosen = cpus[:DEFAULT_CPU_REPLICAS]
        reason = (
            f"{_no_gpu()} So {len(chosen)} logical CPU {what}(s) out of the {len(cpus)} logical CPU device(s), "
            f"to train {name} on the CPU. Choose others with --devices."
        )
        return chosen, _devices(", ".join(chosen), reason)

    return choose


def every_gpu_else_one_cpu(name: str, registry: DeviceRegistry) -> tuple[list[str], PlacementDecision]:
    """Every visible GPU, else one CPU replica: for a strategy of one process per worker."""
    gpus = _gpus(registry)
    if gpus:
        return gpus, _devices(", ".join(gpus), f"every visible GPU ({len(gpus)})")
    cpu = _cpus(registry)[0]
    # One replica per worker process: the workers already share the cores between them.
    return [cpu], _devices(cpu, f"{_no_gpu()} So one CPU replica per worker process.")


def local_rank_device(name: str, registry: DeviceRegistry) -> tuple[list[str], PlacementDecision]:
    """The GPU of this worker's local rank, else the CPU: one device per worker process
    (`strategies.sharded.placement.default_devices`), not the first GPU, which every local rank would share."""
    from stratagem.strategies.sharded.placement import default_devices

    return default_devices(name, registry)


# ---- the builders: each imports its own strategy, when called --------------------------------------------------


def _mirrored(devices: list[str], registry: DeviceRegistry) -> Strategy:
    from stratagem.strategies.mirrored import MirroredStrategy

    return MirroredStrategy(devices, registry=registry)


def _bench_mirrored(devices: list[str], options: Mapping[str, Any]) -> Strategy:
    from stratagem.strategies.mirrored import MirroredStrategy

    return MirroredStrategy(devices, timeout=options["timeout"], registry=options.get("registry"))


def _one_device(devices: list[str], registry: DeviceRegistry) -> Strategy:
    from stratagem.strategies.one_device import OneDeviceStrategy

    return OneDeviceStrategy(devices[0], registry=registry)


def _bench_one_device(devices: list[str], options: Mapping[str, Any]) -> Strategy:
    from stratagem.strategies.one_device import OneDeviceStrategy

    return OneDeviceStrategy(devices[0], timeout=options["timeout"], registry=options.get("registry"))


def _multi_worker(devices: list[str], registry: DeviceRegistry) -> Strategy:
    from stratagem.strategies.multi_worker.strategy import MultiWorkerMirroredStrategy

    return MultiWorkerMirroredStrategy(devices, registry=registry)


def _bench_multi_worker(devices: list[str], options: Mapping[str, Any]) -> Strategy:
    from stratagem.strategies.multi_worker.strategy import MultiWorkerMirroredStrategy

    return MultiWorkerMirroredStrategy(devices, cluster=options["cluster"], timeout=options["timeout"])


def _central_storage(devices: list[str], registry: DeviceRegistry) -> Strategy:
    from stratagem.strategies.central_storage.strategy import CentralStorageStrategy

    return CentralStorageStrategy(devices, registry=registry)


def _bench_central_storage(devices: list[str], options: Mapping[str, Any]) -> Strategy:
    from stratagem.strategies.central_storage.strategy import CentralStorageStrategy

    return CentralStorageStrategy(devices, timeout=options["timeout"], registry=options.get("registry"))


def _model_parallel(devices: list[str], registry: DeviceRegistry) -> Strategy:
    from stratagem.strategies.model_parallel.strategy import ModelParallelStrategy

    # Two micro-batches per global batch, so the stages really work at the same time (GPipe).
    return ModelParallelStrategy(stages=devices, num_micro_batches=MODEL_PARALLEL_MICRO_BATCHES, registry=registry)


def _parameter_server(devices: list[str], registry: DeviceRegistry) -> Strategy:
    from stratagem.strategies.parameter_server.strategy import ParameterServerStrategy

    # The cluster (chief, workers, parameter servers) comes from TF_CONFIG, as `stratagem launch --ps` sets it.
    return ParameterServerStrategy()


def _sharded(devices: list[str], registry: DeviceRegistry) -> Strategy:
    from stratagem.strategies.sharded.strategy import ShardedStrategy

    # One device per worker process: the parameters, gradients and optimizer state are cut across them.
    return ShardedStrategy(device=devices[0])


def _bench_sharded(devices: list[str], options: Mapping[str, Any]) -> Strategy:
    from stratagem.strategies.sharded.strategy import ShardedStrategy

    return ShardedStrategy(device=devices[0], cluster=options["cluster"], timeout=options["timeout"])


def _tensor_parallel(devices: list[str], registry: DeviceRegistry) -> Strategy:
    from stratagem.strategies.tensor_parallel.strategy import TensorParallelStrategy

    # By name alone every parameter is replicated: the layouts come from sg.strategy_from_env(layout_map=...).
    return TensorParallelStrategy(device=devices[0])


STRATEGIES = StrategyRegistry(
    [
        StrategyRecord(
            name="mirrored",
            strategy_path="stratagem.strategies.mirrored:MirroredStrategy",
            default_devices=every_gpu_else_cpus("replica"),
            build=_mirrored,
            bench_build=_bench_mirrored,
        ),
        StrategyRecord(
            name="one_device",
            strategy_path="stratagem.strategies.one_device:OneDeviceStrategy",
            default_devices=first_device,
            build=_one_device,
            max_devices=1,
            bench_build=_bench_one_device,
        ),
        StrategyRecord(
            name="multi_worker",
            strategy_path="stratagem.strategies.multi_worker.strategy:MultiWorkerMirroredStrategy",
            default_devices=every_gpu_else_one_cpu,
            build=_multi_worker,
            one_process_per_worker=True,
            bench_build=_bench_multi_worker,
            techniques_path="stratagem.strategies.multi_worker.techniques:TECHNIQUES",  # replication
        ),
        StrategyRecord(
            name="central_storage",
            strategy_path="stratagem.strategies.central_storage.strategy:CentralStorageStrategy",
            default_devices=every_gpu_else_cpus("replica"),
            build=_central_storage,
            bench_build=_bench_central_storage,
        ),
        StrategyRecord(
            name="model_parallel",
            strategy_path="stratagem.strategies.model_parallel.strategy:ModelParallelStrategy",
            default_devices=every_gpu_else_cpus("stage"),
            build=_model_parallel,
        ),
        StrategyRecord(
            name="parameter_server",
            strategy_path="stratagem.strategies.parameter_server.strategy:ParameterServerStrategy",
            default_devices=every_gpu_else_one_cpu,
            build=_parameter_server,
            one_process_per_worker=True,
            parameter_servers=True,
        ),
        StrategyRecord(
            name="sharded",
            strategy_path="stratagem.strategies.sharded.strategy:ShardedStrategy",
            default_devices=local_rank_device,
            build=_sharded,
            one_process_per_worker=True,
            max_devices=1,
            bench_build=_bench_sharded,
            techniques_path="stratagem.strategies.sharded.techniques:TECHNIQUES",  # data sharding
        ),
        StrategyRecord(
            name="tensor_parallel",
            strategy_path="stratagem.strategies.tensor_parallel.strategy:TensorParallelStrategy",
            default_devices=local_rank_device,  # one device per worker process, as sharded's
            build=_tensor_parallel,
            one_process_per_worker=True,
            max_devices=1,
            # tensor parallel along `model`, then data sharding and replication along `data`
            techniques_path="stratagem.strategies.tensor_parallel.techniques:TECHNIQUES",
        ),
    ]
)
"""Every strategy that can be chosen by name, in the order the command line lists them."""
