"""stratagem: train PyTorch models with tf.distribute-style strategies, never a silent fallback.

    import stratagem as sg
    strategy = sg.MirroredStrategy()
    print(strategy.explain())
"""

from stratagem import data, devices, diagnose
from stratagem.cluster.function import launch
from stratagem.data.split import InputContext
from stratagem.diagnose.placement import log_placement, soft_placement
from stratagem.errors import (
    CollectiveTimeoutError,
    CorruptCheckpointError,
    DeviceError,
    GpuUnavailableError,
    InputError,
    LaunchError,
    PlacementError,
    ReplicaError,
    StratagemError,
)
from stratagem.strategies import (
    CentralStorageStrategy,
    ClusterCoordinator,
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    MirroredStrategy,
    ModelParallelStrategy,
    MultiWorkerMirroredStrategy,
    OneDeviceStrategy,
    ParameterServerStrategy,
    ReplicaContext,
    Strategy,
    current_replica_context,
)
from stratagem.train import callbacks, metrics
from stratagem.train.fit import History, fit
from stratagem.train.from_env import strategy_from_env
from stratagem.train.loop import evaluate
from stratagem.train.seeding import seed_everything
from stratagem.values import PerReplica, ReduceOp

__version__ = "0.1.0"

__all__ = [
    "data",
    "devices",
    "diagnose",
    "CentralStorageStrategy",
    "ClusterCoordinator",
    "CollectiveTimeoutError",
    "CorruptCheckpointError",
    "DeviceError",
    "FixedShardsPartitioner",
    "GpuUnavailableError",
    "History",
    "InputContext",
    "InputError",
    "LaunchError",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "MirroredStrategy",
    "ModelParallelStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "PerReplica",
    "PlacementError",
    "ReduceOp",
    "ReplicaContext",
    "ReplicaError",
    "StratagemError",
    "Strategy",
    "current_replica_context",
    "callbacks",
    "evaluate",
    "fit",
    "launch",
    "log_placement",
    "metrics",
    "seed_everything",
    "soft_placement",
    "strategy_from_env",
]
