"""MultiWorkerMirroredStrategy: one process per worker, replicas mirrored across them.

`strategy` assembles the parts; `techniques` is its table of techniques, one: replication along `data` (the model
handed to the replica set); `across` sums gradients across workers; `straggler_phases` finds the phase of compute a
straggler is slow in, from the trace. Each worker's input and default devices are `worker_group/`'s.
"""
