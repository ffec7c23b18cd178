"""stratagem: train PyTorch models with tf.distribute-style strategies, never a silent fallback.

Example:
    >>> import stratagem as sg
    >>> strategy = sg.MirroredStrategy()
    >>> print(strategy.explain())  # doctest: +SKIP
"""

from stratagem import data, devices, diagnose
from stratagem.cluster.function import launch
from stratagem.data.split import InputContext
from stratagem.diagnose.placement import log_placement, soft_placement
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
    ShardedStrategy,
    Strategy,
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
