"""The strategy family: each name is imported when first used.

A strategy's class comes from its record (`records.STRATEGIES`, the one list of strategies), so
``from stratagem.strategies import MirroredStrategy`` imports MirroredStrategy's module and not the other
strategies'; the other names here are the vocabulary the strategies share (PEP 562 `__getattr__`, the real
imports under `TYPE_CHECKING` for type checkers).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stratagem.strategies.records import STRATEGIES

if TYPE_CHECKING:
    # `X as X`: re-exported for type checkers (PEP 484), since `__all__` is computed.
    from stratagem.cluster.mesh import DeviceMesh as DeviceMesh
    from stratagem.data.distributed_dataset import DistributedDataset as DistributedDataset
    from stratagem.strategies.base import Strategy as Strategy
    from stratagem.strategies.central_storage.strategy import CentralStorageStrategy as CentralStorageStrategy
    from stratagem.strategies.explain import Explanation as Explanation
    from stratagem.strategies.mirrored import MirroredStrategy as MirroredStrategy
    from stratagem.strategies.model_parallel.strategy import ModelParallelStrategy as ModelParallelStrategy
    from stratagem.strategies.multi_worker.strategy import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
    from stratagem.strategies.one_device import OneDeviceStrategy as OneDeviceStrategy
    from stratagem.strategies.parameter_server.coordinator import ClusterCoordinator as ClusterCoordinator
    from stratagem.strategies.parameter_server.partitioners import FixedShardsPartitioner as FixedShardsPartitioner
    from stratagem.strategies.parameter_server.partitioners import MaxSizePartitioner as MaxSizePartitioner
    from stratagem.strategies.parameter_server.partitioners import MinSizePartitioner as MinSizePartitioner
    from stratagem.strategies.parameter_server.strategy import ParameterServerStrategy as ParameterServerStrategy
    from stratagem.strategies.replica_context import ReplicaContext as ReplicaContext
    from stratagem.strategies.replica_context import current_replica_context as current_replica_context
    from stratagem.strategies.sharded.strategy import ShardedStrategy as ShardedStrategy
    from stratagem.strategies.tensor_parallel.mesh import LayoutMap as LayoutMap
    from stratagem.strategies.tensor_parallel.strategy import TensorParallelStrategy as TensorParallelStrategy

# name -> the module that defines it: every strategy's class by its record, then the shared names.
LAZY_NAMES: dict[str, str] = {record.class_name: record.module for record in STRATEGIES} | {
    "ClusterCoordinator": "stratagem.strategies.parameter_server.coordinator",
    "DeviceMesh": "stratagem.cluster.mesh",
    "DistributedDataset": "stratagem.data.distributed_dataset",
    "Explanation": "stratagem.strategies.explain",
    "FixedShardsPartitioner": "stratagem.strategies.parameter_server.partitioners",
    "LayoutMap": "stratagem.strategies.tensor_parallel.mesh",
    "MaxSizePartitioner": "stratagem.strategies.parameter_server.partitioners",
    "MinSizePartitioner": "stratagem.strategies.parameter_server.partitioners",
    "ReplicaContext": "stratagem.strategies.replica_context",
    "Strategy": "stratagem.strategies.base",
    "current_replica_context": "stratagem.strategies.replica_context",
}


def __getattr__(name: str) -> Any:
    """``stratagem.strategies.<name>`` for a name of `__all__` not imported yet: imports its module only."""
    if name not in LAZY_NAMES:
        raise AttributeError(f"module 'stratagem.strategies' has no attribute {name!r}")
    value = getattr(importlib.import_module(LAZY_NAMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(LAZY_NAMES))


__all__ = sorted(LAZY_NAMES)
