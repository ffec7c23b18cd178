"""The parts the data-parallel strategies share (OneDevice, Mirrored, CentralStorage, MultiWorkerMirrored).

A `replica_set.ReplicaSet` runs one process's replicas in lockstep; the other modules are its parts:
placement, the replicas and their optimizer, the local combination of gradients, BatchNorm statistics,
empty slices, accumulation, loss weights, autocast and mixed precision, compiled models, LR schedulers,
gather. docs/architecture.md lists which strategy uses which.
"""
