"""What every strategy of one process per worker shares (MultiWorkerMirrored, Sharded, TensorParallel):

- `strategy.py`: `WorkerGroupStrategy`, the `Strategy` members such a strategy has because it runs on a
  `cluster.worker_group.WorkerGroup` (cluster, is_chief, reduce and gather across workers, barrier, the input,
  the batch check, close at exit), written once;
- `input.py`: each worker's part of every global batch (`WorkerBatches`), the end-of-data agreement
  (`MultiWorkerDataset`), and the input sharding `explain()` reports;
- `agreement.py`: the fingerprint of a step's batch every worker sends (`BatchAgreement`), and
  `step_agreement.py`: when it is compared (riding a sum the step makes, or alone when the step function returns);
- `devices.py`: a worker's default devices (the GPU of its local rank, else the CPU);
- `stragglers.py`: each step's phase times, and the worker named slower than its peers;
- `techniques.py`: what a strategy built of techniques runs at `distribute` (`Technique`, each technique's check, the
  table applied in order over the mesh's axes, `explain()`'s `techniques` line); each strategy's table is in its own
  folder (`multi_worker/`, `sharded/`, `tensor_parallel/` `techniques.py`), named by its record.
"""
