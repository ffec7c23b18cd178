"""stratagem: train PyTorch models with tf.distribute-style strategies, never a silent fallback.

Example:
    >>> import stratagem as sg
    >>> strategy = sg.MirroredStrategy()
    >>> print(strategy.explain())  # doctest: +SKIP

The package imports its error classes and the strategy records (`strategies/records.py`, which import no
torch) at once, and everything else when first used: `sg.MirroredStrategy` imports MirroredStrategy's module
and no other strategy's. So a process that needs one part, such as `stratagem launch` starting its tasks, does
not pay for torch, torch.distributed and the strategies. The strategies' names come from their records, the
one list of strategies; the imports under `TYPE_CHECKING` are for type checkers, and a test keeps them equal.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stratagem.errors import (
    BackupDirectoryInUseError,
    CheckpointWriteError,
    ClusterError,
    CollectiveTimeoutError,
    CorruptCheckpointError,
    DeviceConfigurationError,
    DeviceError,
    GpuUnavailableError,
    InputError,
    LaunchError,
    MemoryEstimateError,
    MemoryEstimateInputError,
    ParameterServerError,
    PlacementError,
    Preempted,
    RendezvousError,
    ReplicaError,
    StratagemError,
    WireFormatError,
)
from stratagem.strategies.records import STRATEGIES

if TYPE_CHECKING:
    from stratagem import data, devices, diagnose
    from stratagem.cluster.function import launch
    from stratagem.data.split import InputContext
    from stratagem.diagnose.placement import log_placement, soft_placement

    # `X as X`: re-exported for type checkers (PEP 484); at run time these names come from the records.
    from stratagem.strategies import CentralStorageStrategy as CentralStorageStrategy
    from stratagem.strategies import (
        ClusterCoordinator,
        DeviceMesh,
        FixedShardsPartitioner,
        LayoutMap,
        MaxSizePartitioner,
        MinSizePartitioner,
        ReplicaContext,
        Strategy,
        current_replica_context,
    )
    from stratagem.strategies import MirroredStrategy as MirroredStrategy
    from stratagem.strategies import ModelParallelStrategy as ModelParallelStrategy
    from stratagem.strategies import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
    from stratagem.strategies import OneDeviceStrategy as OneDeviceStrategy
    from stratagem.strategies import ParameterServerStrategy as ParameterServerStrategy
    from stratagem.strategies import ShardedStrategy as ShardedStrategy
    from stratagem.strategies import TensorParallelStrategy as TensorParallelStrategy
    from stratagem.strategies.data_parallel.loss_weight import set_loss_weight
    from stratagem.strategies.run_inputs import replicated
    from stratagem.train import callbacks, metrics
    from stratagem.train.fit import History, fit
    from stratagem.train.from_env import strategy_from_env
    from stratagem.train.loop import evaluate
    from stratagem.train.seeding import seed_everything
    from stratagem.values import PerReplica, ReduceOp

__version__ = "0.1.0"

# name -> (module, attribute in it; None: the name is the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "data": ("stratagem.data", None),
    "devices": ("stratagem.devices", None),
    "diagnose": ("stratagem.diagnose", None),
    "launch": ("stratagem.cluster.function", "launch"),
    "InputContext": ("stratagem.data.split", "InputContext"),
    "log_placement": ("stratagem.diagnose.placement", "log_placement"),
    "soft_placement": ("stratagem.diagnose.placement", "soft_placement"),
    "ClusterCoordinator": ("stratagem.strategies.parameter_server.coordinator", "ClusterCoordinator"),
    "FixedShardsPartitioner": ("stratagem.strategies.parameter_server.partitioners", "FixedShardsPartitioner"),
    "MaxSizePartitioner": ("stratagem.strategies.parameter_server.partitioners", "MaxSizePartitioner"),
    "MinSizePartitioner": ("stratagem.strategies.parameter_server.partitioners", "MinSizePartitioner"),
    "ReplicaContext": ("stratagem.strategies.replica_context", "ReplicaContext"),
    "DeviceMesh": ("stratagem.cluster.mesh", "DeviceMesh"),
    "LayoutMap": ("stratagem.strategies.tensor_parallel.mesh", "LayoutMap"),
    "Strategy": ("stratagem.strategies.base", "Strategy"),
    "current_replica_context": ("stratagem.strategies.replica_context", "current_replica_context"),
    "set_loss_weight": ("stratagem.strategies.data_parallel.loss_weight", "set_loss_weight"),
    "replicated": ("stratagem.strategies.run_inputs", "replicated"),
    "callbacks": ("stratagem.train.callbacks", None),
    "metrics": ("stratagem.train.metrics", None),
    "History": ("stratagem.train.fit", "History"),
    "fit": ("stratagem.train.fit", "fit"),
    "strategy_from_env": ("stratagem.train.from_env", "strategy_from_env"),
    "evaluate": ("stratagem.train.loop", "evaluate"),
    "seed_everything": ("stratagem.train.seeding", "seed_everything"),
    "PerReplica": ("stratagem.values", "PerReplica"),
    "ReduceOp": ("stratagem.values", "ReduceOp"),
    # Every strategy's class, from its record: sg.MirroredStrategy imports MirroredStrategy's module only.
    **{record.class_name: (record.module, record.class_name) for record in STRATEGIES},
}


def __getattr__(name: str) -> Any:
    """`sg.<name>` for a name of `__all__` not imported yet: imports it (then it is an ordinary attribute)."""
    if name not in _LAZY:
        raise AttributeError(f"module 'stratagem' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = importlib.import_module(module)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "data",
    "devices",
    "diagnose",
    "ClusterCoordinator",
    "ClusterError",
    "CollectiveTimeoutError",
    "CorruptCheckpointError",
    "BackupDirectoryInUseError",
    "CheckpointWriteError",
    "Preempted",
    "DeviceConfigurationError",
    "DeviceError",
    "FixedShardsPartitioner",
    "GpuUnavailableError",
    "History",
    "InputContext",
    "InputError",
    "LaunchError",
    "MaxSizePartitioner",
    "MemoryEstimateError",
    "MemoryEstimateInputError",
    "MinSizePartitioner",
    "ParameterServerError",
    "PerReplica",
    "PlacementError",
    "ReduceOp",
    "RendezvousError",
    "ReplicaContext",
    "DeviceMesh",
    "LayoutMap",
    "ReplicaError",
    "StratagemError",
    "Strategy",
    "WireFormatError",
    "current_replica_context",
    "replicated",
    "callbacks",
    "evaluate",
    "fit",
    "launch",
    "log_placement",
    "metrics",
    "seed_everything",
    "set_loss_weight",
    "soft_placement",
    "strategy_from_env",
    *(record.class_name for record in STRATEGIES),
]
