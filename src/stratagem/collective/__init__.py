"""Moving and reducing tensors across replicas."""

from stratagem.collective.local import (
    InMemoryReduce,
    LocalReducer,
    NcclReduce,
    ReduceToOneDevice,
    choose_local_reducer,
)

__all__ = ["InMemoryReduce", "LocalReducer", "NcclReduce", "ReduceToOneDevice", "choose_local_reducer"]
