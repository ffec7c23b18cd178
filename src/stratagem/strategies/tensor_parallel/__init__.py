"""Tensor parallelism on a layout map (Keras 3's `keras.distribution`), over torch's DTensor, in the order
`strategy.py` applies the parts:

- `mesh.py`: `DeviceMesh` and `LayoutMap`, and every check that needs no process group (the mesh against the
  worker count, a layout's axes and length, tied parameters);
- `styles.py`: which splits each module's forward honours (Linear, transformers' Conv1D, Embedding, attention
  heads), refused by module name before anything is placed;
- `techniques.py`: the table of techniques applied to the model, in their order, each over its mesh axes (the next
  three), run by `worker_group/techniques.py`'s machinery;
- `apply.py`: `apply_tensor_parallel`: each parameter made a DTensor of the mesh, split along `model`, the forward
  run under DTensor's implicit replication, the outputs handed back as whole tensors;
- `data_sharding.py`: `apply_data_sharding`: ZeRO-3 along `data` (FSDP2 after the split) for the layouts that name
  it;
- `data_axis.py`: `apply_replication`: the `data` axis of a 2-D mesh: each model group's gradients of the
  parameters replicated along it summed across it, weighted by each group's share of the global batch;
- `hooks.py`: what makes any step function train the split model, `sg.fit`'s included: a convolution's plain
  input made a replicated DTensor, and a backward outside `strategy.run` refused with the fix;
- `memory.py` and `limit.py`: this rank's memory plan, and the plan held against the process's memory limit;
- `decisions.py`: what `explain()` says: each parameter's layout and the redistributions a step implies.
"""

from stratagem.strategies.tensor_parallel.mesh import DeviceMesh, LayoutMap
from stratagem.strategies.tensor_parallel.strategy import TensorParallelStrategy

__all__ = ["DeviceMesh", "LayoutMap", "TensorParallelStrategy"]
