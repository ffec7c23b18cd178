"""What exists because CPU replicas are threads of one process, and only for that.

On a GPU every replica has its own device, random generator and copy of the parameters. Replicas that are
threads on the CPU share one process, one default generator and, where their logical devices are one physical
CPU, one copy of the parameters; each module here restores one-device semantics for that case:

- `replica_random.py`: each replica thread but the first draws from its own seeded generator (a dispatch mode
  hands it to the random operators on its thread), so dropout repeats run to run;
- `shared_parameters.py`: replicas that share one copy of the parameters, each updating 1/N of it;
- `hand_updates.py`: the refusal of an in-place change to those shared parameters made outside the optimizer;
- `batch_norm_native.py` (and `.cpp`): exact BatchNorm's layer call and its meetings in C++, an opt-in speed-up
  built ahead of time by `stratagem native build`.

The data-parallel parts elsewhere in `data_parallel/` serve GPU and CPU replicas alike.
"""
