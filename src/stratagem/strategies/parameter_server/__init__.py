"""Parameter-server training over gRPC: the strategy, its coordinator, partitioners, service and wire format.

    strategy = sg.ParameterServerStrategy()              # TF_CONFIG with ps tasks, or stratagem launch --ps 1
    model, optimizer = strategy.distribute(Net(), torch.optim.Adam(...))
    coordinator = sg.ClusterCoordinator(strategy)
    loss = coordinator.schedule(train_step, args=(iterator,))
    coordinator.join()

Modules: ``wire`` (tensors as raw bytes), ``transport`` (authenticated gRPC), ``partitioners``,
``server`` (the parameter-server task), ``variables`` (pull, push, checkpoints), ``functions``
(how functions and arguments travel), ``worker``, ``coordinator``, ``strategy``.
"""

from stratagem.strategies.parameter_server.coordinator import (
    ClusterCoordinator,
    PerWorkerDataset,
    PerWorkerIterator,
    RemoteValue,
)
from stratagem.strategies.parameter_server.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
)
from stratagem.strategies.parameter_server.strategy import (
    InProcessCluster,
    ParameterServerStrategy,
)

__all__ = [
    "ClusterCoordinator",
    "FixedShardsPartitioner",
    "InProcessCluster",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "ParameterServerStrategy",
    "Partitioner",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "RemoteValue",
]
