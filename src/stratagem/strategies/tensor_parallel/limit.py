"""TensorParallelStrategy's memory plan held against the process's memory limit in `distribute`, before anything is
split, as ShardedStrategy's is (`strategies/memory_fit.py`): a plan over the limit is refused with the plan, the
limit and the first mesh with more `model` workers whose plan fits, instead of training until the kernel kills a
worker."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from stratagem.diagnose.memory_limit import read_memory_limit
from stratagem.strategies.memory_fit import Alternative, check_plan_fits
from stratagem.strategies.tensor_parallel.memory import TensorParallelMemoryPlan, plan_tensor_parallel_memory
from stratagem.strategies.tensor_parallel.mesh import DeviceMesh, ParameterLayout


def check_limit(
    plan: TensorParallelMemoryPlan,
    layouts: Sequence[ParameterLayout],
    parameters: Mapping[str, nn.Parameter],
    optimizer: torch.optim.Optimizer | None,
    *,
    mesh: DeviceMesh,
    device: torch.device,
) -> None:
    """Refuses `plan` (this rank's, for the model as the user built it) beyond the headroom of this process's
    tightest memory limit; the user's model is built already, so the limit counts it as used."""
    check_plan_fits(
        plan.total,
        read_memory_limit(device),
        strategy=f"TensorParallelStrategy on the mesh {mesh.shape} {mesh.axis_names}",
        held=plan.whole_model,
        alternatives=lambda: wider_meshes(layouts, parameters, optimizer, mesh=mesh, activations=plan.activations),
    )


def wider_meshes(
    layouts: Sequence[ParameterLayout],
    parameters: Mapping[str, nn.Parameter],
    optimizer: torch.optim.Optimizer | None,
    *,
    mesh: DeviceMesh,
    activations: int = 0,
) -> list[Alternative]:
    """The plans of the same layouts with 1 to 7 times more `model` workers than `mesh` has (the `data` axis
    kept), fewest first, each for rank 0 (whose parts are the largest of an uneven split). The activations are kept
    as given: a rank's part of them shrinks with more `model` workers only where the layout splits them."""
    model = mesh.axis_size("model")
    tried = []
    for n in range(model + 1, 8 * model + 1):
        shape = tuple(n if axis == "model" else size for axis, size in zip(mesh.axis_names, mesh.shape))
        wider = DeviceMesh(shape, mesh.axis_names)
        plan = plan_tensor_parallel_memory(layouts, parameters, optimizer, mesh=wider, rank=0, activations=activations)
        if plan.total is not None:
            tried.append(
                Alternative(
                    strategy=f"the mesh {wider.shape} {wider.axis_names} ({wider.size} workers)", total=plan.total
                )
            )
    return tried
