"""MultiWorkerMirroredStrategy: one process per worker, replicas mirrored across them.

`strategy` assembles the parts; `across` sums gradients across workers; `input` gives each worker its
part of the global batches; `devices` picks a worker's default devices.
"""
