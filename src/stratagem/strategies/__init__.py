"""The strategy family."""

from stratagem.strategies.base import DistributedDataset, Strategy
from stratagem.strategies.central_storage.strategy import CentralStorageStrategy
from stratagem.strategies.explain import Explanation
from stratagem.strategies.mirrored import MirroredStrategy
from stratagem.strategies.model_parallel.strategy import ModelParallelStrategy
from stratagem.strategies.multi_worker.strategy import MultiWorkerMirroredStrategy
from stratagem.strategies.one_device import OneDeviceStrategy
from stratagem.strategies.sharded import ShardedStrategy
from stratagem.strategies.tensor_parallel import DeviceMesh, LayoutMap, TensorParallelStrategy
from stratagem.strategies.parameter_server import (
    ClusterCoordinator,
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    ParameterServerStrategy,
)
from stratagem.strategies.data_parallel.replicas import ReplicaContext, current_replica_context

__all__ = [
    "CentralStorageStrategy",
    "ClusterCoordinator",
    "DeviceMesh",
    "DistributedDataset",
    "Explanation",
    "FixedShardsPartitioner",
    "LayoutMap",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "MirroredStrategy",
    "ModelParallelStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "ReplicaContext",
    "ShardedStrategy",
    "Strategy",
    "TensorParallelStrategy",
    "current_replica_context",
]
