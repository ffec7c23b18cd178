"""`apply_data_sharding`: ZeRO-3 on the `data` axis, for each parameter whose layout names it, on torch's FSDP2.

A layout such as ``("data", "model")`` (Keras 3 lets a weight be split over the batch axis of its `DeviceMesh`
too) keeps 1/D of the parameter's `model` part on each of the D workers of the `data` axis, with its gradient and
optimizer state: the parameter is all-gathered across `data` before the forward of the module that owns it and
resharded after it, all-gathered again for its backward, and its gradient reduce-scattered back into the shards.

Built on FSDP2 (`fully_shard`), applied after the tensor-parallel split as torchtitan applies it (TP, then FSDP over
the data axis), with the mesh given whole (`DataParallelMeshDims(shard="data")`): the parameters are already
DTensors on the 2-D mesh, replicated along `data` (`apply.apply_tensor_parallel`), and FSDP2 turns the `data`
placement of the ones it takes into `Shard(dim)`. Every parameter stays a DTensor of the one 2-D mesh, sharded or
not: torch's `clip_grad_norm_` stacks the norms of all gradients, which DTensor refuses across two meshes ("All
operands in aten.stack.default must have the same mesh"), as the user's clipping did when the sharded parameters
lived on the 2-D mesh and the others on the `model` axis alone. FSDP2 rather than a home-made gather: its
parameters are DTensors of their placements, so `StateShards` (torch.distributed.checkpoint) saves and loads them
as it does ShardedStrategy's, and its units are what ShardedStrategy has measured.

Exact on any split of the global batch: every unit reduces with a plain SUM (no divide factor), each worker's flat
gradient buffer multiplied first by its group's share of the batch (`weight()`, read when the reduce-scatter runs,
so a `sg.set_loss_weight` made before backward counts), as ShardedStrategy's units do (`sharded/weighting.py`) and
as the data axis weighs the replicated parameters (`data_axis.py`).

Units: the module that owns a parameter (its ``fully_shard`` given every other parameter as ignored), innermost
first, then the model's root, which takes a tied parameter (one tensor under two modules' names: GPT-2's `wte` and
`lm_head`). A unit's parameters are gathered whole (along `data`) only while it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratagem.errors import InputError
from stratagem.strategies.tensor_parallel.mesh import DeviceMesh, ParameterLayout


def data_dim(layout: ParameterLayout) -> int | None:
    """The dimension the layout splits along `data`, or None."""
    return layout.layout.index("data") if "data" in layout.layout else None


def unit_of(layout: ParameterLayout) -> str:
    """The module whose `fully_shard` takes a parameter sharded along `data`: its owner, or the root ("") for a
    tied one (one tensor under two modules' names, gathered once for both)."""
    return layout.names[0].rpartition(".")[0] if len(layout.names) == 1 else ""


def sharding_units(layouts: Sequence[ParameterLayout]) -> list[str]:
    """The modules `fully_shard` is applied to, in order: innermost first, then by name, the root last (as
    torchtitan's `apply_fsdp`: it takes what no inner unit took). The same order on every worker (a set's order
    follows each process's string hashing), so that FSDP2's units, and the collectives its final callback issues,
    line up across workers."""
    inner = {unit_of(layout) for layout in layouts if data_dim(layout) is not None} - {""}
    return sorted(inner, key=lambda prefix: (-prefix.count("."), prefix)) + [""]


def check_data_sharding(layouts: Sequence[ParameterLayout], mesh: DeviceMesh) -> None:
    """Refuses, before anything is placed, a data-axis split FSDP2 cannot make: a dimension other than the first
    whose size the `data` axis does not divide (FSDP2 pads only the first dimension of a shard)."""
    data = mesh.axis_size("data")
    for layout in layouts:
        dim = data_dim(layout)
        if dim is not None and dim > 0 and layout.shape[dim] % data:
            raise InputError(
                f"Sharding {layout.names[0]} along 'data' splits its dimension {dim} (size {layout.shape[dim]}), which "
                f"{data} data workers cannot split evenly: FSDP2, which shards it, pads only dimension 0 (not "
                f"supported yet). Received: {layout.key!r} -> {layout.layout}, shape {layout.shape}, mesh {mesh.shape} "
                f"{mesh.axis_names}. Put 'data' on dimension 0, or on a dimension whose size {data} divides."
            )


def weighted_at_reduce(weight: Callable[[], float]) -> Any:
    """ShardedStrategy's weighted reduce-scatter of SUM (`sharded/reduce_scatter.py`), its weight read from
    `weight()` as each unit reduces. Made here, not at import: that module imports FSDP2 (over a second of CPU),
    which a layout naming no `data` never needs."""
    from stratagem.strategies.sharded.reduce_scatter import WeightedReduceScatter

    class WeightedAtReduce(WeightedReduceScatter):
        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            op: object,
            async_op: bool = False,
        ) -> dist.Work | None:
            self.weight = weight()
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    return WeightedAtReduce()


@dataclass(frozen=True)
class DataSharding:
    """What `apply_data_sharding` did: the names of the parameters it sharded and its units, innermost first."""

    names: frozenset[str]
    """Every name of every parameter sharded along `data` (a tied one under each of its names)."""
    units: tuple[str, ...]
    """The modules `fully_shard` was applied to ("" for the root), in the order it was."""

    def remove(self) -> None:
        """Nothing to take off: FSDP2 stays on the model, as ShardedStrategy's does."""


def apply_data_sharding(
    model: nn.Module, mesh: Any, layouts: Sequence[ParameterLayout], weight: Callable[[], float]
) -> DataSharding:
    """FSDP2 on the units that own a parameter whose layout names `data` (`mesh`: torch's 2-D DeviceMesh the
    parameters are DTensors of, replicated along `data`), each such parameter sharded along the dimension its layout
    gives; the gradients reduce-scattered as a SUM, each worker's weighted by `weight()` first. Every other parameter
    is left as it is (`ignored_params`), for `data_axis.apply_replication`."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_api import DataParallelMeshDims
    from torch.distributed.tensor import Shard

    sharded = [layout for layout in layouts if data_dim(layout) is not None]
    if not sharded:
        return DataSharding(frozenset(), ())
    params = dict(model.named_parameters(remove_duplicate=False))
    dims = {id(params[layout.names[0]]): layout.layout.index("data") for layout in sharded}
    owner_of = {layout.names[0]: unit_of(layout) for layout in sharded}
    units = sharding_units(sharded)

    def placement(param: nn.Parameter) -> Any:
        return Shard(dims[id(param)])

    comm = weighted_at_reduce(weight)
    for prefix in units:
        module = model.get_submodule(prefix)
        mine = {id(params[name]) for name, owner in owner_of.items() if owner == prefix}
        ignored = {p for p in module.parameters() if id(p) not in mine}
        fully_shard(
            module,
            mesh=mesh,
            dp_mesh_dims=DataParallelMeshDims(shard="data"),
            ignored_params=ignored,
            shard_placement_fn=placement,
        )
        module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        module.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        module.set_custom_reduce_scatter(comm)  # type: ignore[operator]
    return DataSharding(frozenset(n for layout in sharded for n in layout.names), tuple(units))
