"""stratagem: train PyTorch models with tf.distribute-style strategies, never a silent fallback.

Example:
    >>> import stratagem as sg
    >>> strategy = sg.MirroredStrategy()
    >>> print(strategy.explain())  # doctest: +SKIP

The package imports its error classes at once and everything else when first used (`sg.MirroredStrategy`
imports the strategies then), so that a process that needs one part, such as `stratagem launch` starting
its tasks, does not pay for torch, torch.distributed and the strategies.
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

if TYPE_CHECKING:
    from stratagem import data, devices, diagnose
    from stratagem.cluster.function import launch
    from stratagem.data.split import InputContext
    from stratagem.diagnose.placement import log_placement, soft_placement
    from stratagem.strategies import (
        CentralStorageStrategy,
        ClusterCoordinator,
        DeviceMesh,
        FixedShardsPartitioner,
        LayoutMap,
        MaxSizePartitioner,
        MinSizePartitioner,
        MirroredStrategy,
        ModelParallelStrategy,
        MultiWorkerMirroredStrategy,
        OneDeviceStrategy,
        ParameterServerStrategy,
        ReplicaContext,
        ShardedStrategy,
        Strategy,
        TensorParallelStrategy,
        current_replica_context,
    )
    from stratagem.strategies.data_parallel.loss_weight import set_loss_weight
    from stratagem.strategies.data_parallel.run_inputs import replicated
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
    "CentralStorageStrategy": ("stratagem.strategies", "CentralStorageStrategy"),
    "ClusterCoordinator": ("stratagem.strategies", "ClusterCoordinator"),
    "FixedShardsPartitioner": ("stratagem.strategies", "FixedShardsPartitioner"),
    "MaxSizePartitioner": ("stratagem.strategies", "MaxSizePartitioner"),
    "MinSizePartitioner": ("stratagem.strategies", "MinSizePartitioner"),
    "MirroredStrategy": ("stratagem.strategies", "MirroredStrategy"),
    "ModelParallelStrategy": ("stratagem.strategies", "ModelParallelStrategy"),
    "MultiWorkerMirroredStrategy": ("stratagem.strategies", "MultiWorkerMirroredStrategy"),
    "OneDeviceStrategy": ("stratagem.strategies", "OneDeviceStrategy"),
    "ParameterServerStrategy": ("stratagem.strategies", "ParameterServerStrategy"),
    "ReplicaContext": ("stratagem.strategies", "ReplicaContext"),
    "ShardedStrategy": ("stratagem.strategies", "ShardedStrategy"),
    "TensorParallelStrategy": ("stratagem.strategies", "TensorParallelStrategy"),
    "DeviceMesh": ("stratagem.strategies", "DeviceMesh"),
    "LayoutMap": ("stratagem.strategies", "LayoutMap"),
    "Strategy": ("stratagem.strategies", "Strategy"),
    "current_replica_context": ("stratagem.strategies", "current_replica_context"),
    "set_loss_weight": ("stratagem.strategies.data_parallel.loss_weight", "set_loss_weight"),
    "replicated": ("stratagem.strategies.data_parallel.run_inputs", "replicated"),
    "callbacks": ("stratagem.train.callbacks", None),
    "metrics": ("stratagem.train.metrics", None),
    "History": ("stratagem.train.fit", "History"),
    "fit": ("stratagem.train.fit", "fit"),
    "strategy_from_env": ("stratagem.train.from_env", "strategy_from_env"),
    "evaluate": ("stratagem.train.loop", "evaluate"),
    "seed_everything": ("stratagem.train.seeding", "seed_everything"),
    "PerReplica": ("stratagem.values", "PerReplica"),
    "ReduceOp": ("stratagem.values", "ReduceOp"),
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
    "CentralStorageStrategy",
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
    "MirroredStrategy",
    "ModelParallelStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "ParameterServerError",
    "ParameterServerStrategy",
    "PerReplica",
    "PlacementError",
    "ReduceOp",
    "RendezvousError",
    "ReplicaContext",
    "ShardedStrategy",
    "TensorParallelStrategy",
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
]
