"""Strategies by their command-line name: what ``stratagem train --strategy NAME``, ``stratagem launch
--strategy NAME`` and `sg.strategy_from_env` (``STRATAGEM_STRATEGY=NAME``) build, over which devices, and why.

These are library, not demo: a script run under `stratagem launch --strategy NAME` gets the same
strategy over the same default devices as the digits demo of ``stratagem train --strategy NAME``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from stratagem import environ
from stratagem.devices import DeviceRegistry, default_registry
from stratagem.diagnose import PlacementDecision, collect_facts, gpu_unavailable_reason
from stratagem.errors import DeviceError, InputError
from stratagem.strategies import (
    CentralStorageStrategy,
    MirroredStrategy,
    ModelParallelStrategy,
    MultiWorkerMirroredStrategy,
    OneDeviceStrategy,
    ParameterServerStrategy,
    ShardedStrategy,
    Strategy,
)

StrategyBuilder = Callable[[list[str], DeviceRegistry], Strategy]

MODEL_PARALLEL_MICRO_BATCHES = 2

# Two logical CPU replicas on a CPU-only machine: the smallest setup that really exercises the
# gradient combination, and more replicas than cores would only oversubscribe them.
DEFAULT_CPU_REPLICAS = 2

STRATEGY_BUILDERS: dict[str, StrategyBuilder] = {
    "mirrored": lambda names, registry: MirroredStrategy(names, registry=registry),
    "one_device": lambda names, registry: OneDeviceStrategy(names[0], registry=registry),
    "multi_worker": lambda names, registry: MultiWorkerMirroredStrategy(names, registry=registry),
    "central_storage": lambda names, registry: CentralStorageStrategy(names, registry=registry),
    # Two micro-batches per global batch, so the stages really work at the same time (GPipe).
    "model_parallel": lambda names, registry: ModelParallelStrategy(
        stages=names, num_micro_batches=MODEL_PARALLEL_MICRO_BATCHES, registry=registry
    ),
    # The cluster (chief, workers, parameter servers) comes from TF_CONFIG, as `stratagem launch --ps` sets it.
    "parameter_server": lambda names, registry: ParameterServerStrategy(),
    # One process per worker, as multi_worker; the cluster comes from the launcher's variables.
    "sharded": lambda names, registry: ShardedStrategy(device=names[0]),
}
"""How each strategy is built from its devices; add an entry (and, if its default devices differ,
a branch in `_default_devices`) to offer another strategy by name."""

STRATEGY_NAMES = tuple(STRATEGY_BUILDERS)
"""The strategies that can be built by name, by their command-line name."""


def build_strategy(
    name: str, devices: Sequence[str] | None = None, *, registry: DeviceRegistry | None = None
) -> tuple[Strategy, PlacementDecision]:
    """The strategy ``name`` over ``devices``, or over the devices chosen for this machine, and why.

    Without devices, ``mirrored`` uses every GPU, or on a machine without one two logical CPU
    replicas (one if the CPU has a single logical device); ``one_device`` uses ``cuda:0`` when a
    GPU is visible, else ``cpu:0``.

    Example:
        >>> strategy, decision = build_strategy("mirrored", ["cpu:0", "cpu:1"])
        >>> strategy.num_replicas_in_sync, decision.reason
        (2, 'given by --devices')

    Raises:
        InputError: ``name`` is not one of `STRATEGY_NAMES`.
        DeviceError: a device is unknown or unavailable, or ``one_device`` was given several.
    """
    registry = registry or default_registry
    if name not in STRATEGY_NAMES:
        raise InputError(f"Unknown strategy. Received: {name!r}. Choose one of {', '.join(STRATEGY_NAMES)}.")
    if devices is not None:
        names = list(devices)
        if name == "one_device" and len(names) != 1:
            raise DeviceError(
                f"The one_device strategy runs on exactly one device. Received: devices={names}. "
                "Name one device (e.g. --devices cuda:0) or use --strategy mirrored for several."
            )
        decision = PlacementDecision(subject="devices", choice=", ".join(names), reason="given by --devices")
    else:
        names, decision = _default_devices(name, registry)
    return STRATEGY_BUILDERS[name](names, registry), decision


def _default_devices(name: str, registry: DeviceRegistry) -> tuple[list[str], PlacementDecision]:
    gpus = [d.name for d in registry.get_logical_devices("cuda")]
    if gpus:
        chosen = gpus[:1] if name == "one_device" else gpus
        reason = "the first visible GPU" if name == "one_device" else f"every visible GPU ({len(gpus)})"
        return chosen, PlacementDecision(subject="devices", choice=", ".join(chosen), reason=reason)
    why = gpu_unavailable_reason(collect_facts(environ.current()))
    no_gpu = f"no usable GPU: {why.reason}" if why is not None else "no usable GPU"
    cpus = [d.name for d in registry.get_logical_devices("cpu")]
    if name in ("multi_worker", "parameter_server", "sharded"):
        # One replica per worker process: the workers already share the cores between them.
        return cpus[:1], PlacementDecision(
            subject="devices", choice=cpus[0], reason=f"{no_gpu} So one CPU replica per worker process."
        )
    if name == "one_device":
        return cpus[:1], PlacementDecision(subject="devices", choice=cpus[0], reason=f"{no_gpu} So the CPU.")
    chosen = cpus[:DEFAULT_CPU_REPLICAS]
    what = "stage(s)" if name == "model_parallel" else "replica(s)"
    reason = (
        f"{no_gpu} So {len(chosen)} logical CPU {what} out of the {len(cpus)} logical CPU device(s), "
        f"to train {name} on the CPU. Choose others with --devices."
    )
    return chosen, PlacementDecision(subject="devices", choice=", ".join(chosen), reason=reason)
