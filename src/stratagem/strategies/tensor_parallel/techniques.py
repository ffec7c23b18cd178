"""The techniques TensorParallelStrategy applies to a model, each a function over its mesh axes, in a written order.

As torchtitan's `parallelize_llama` applies tensor parallelism, then FSDP, each a plain function, the strategy runs
`TECHNIQUES` in order on the model as the techniques before left it (`Placing`):

1. tensor parallel (`model`), `apply.apply_tensor_parallel`: every parameter a DTensor, split along `model` by its
   layout (of the whole mesh, replicated along `data`, where a layout names `data`; of the `model` axis otherwise); `apply.grads_in_layout` puts each gradient into its parameter's
   placement as it is accumulated. First, because the data-axis techniques take its DTensors as they are.
2. data sharding (`data`), `data_sharding.apply_data_sharding`: ZeRO-3 on FSDP2 for the parameters whose layout
   names `data`. After the split (FSDP2 shards a DTensor parameter's placement along `data`, torchtitan's order),
   before replication, which needs to know which parameters it took.
3. replication (`data`), `data_axis.apply_replication`: every other parameter's gradient summed across `data` at the
   end of backward, weighted by the group's share of the global batch.

A technique whose axis the mesh does not have does nothing (a mesh of one `model` axis runs the first alone).
`Technique`, the order and the checks are the machinery every strategy of techniques shares
(`worker_group/techniques.py`); this module holds TensorParallelStrategy's table and its placing state.
To add a technique: its function (and its check of the layouts) in a module of this package, its row in `TECHNIQUES`
at its place in the order (with the reason for the place), what it holds in `memory.py`, its section in
docs/tensor_parallel.md and its tests (docs/architecture.md, "Adding a technique").

Example:
    >>> [(t.name, t.axes) for t in TECHNIQUES]
    [('tensor parallel', ('model',)), ('data sharding', ('data',)), ('replication', ('data',))]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from stratagem.diagnose import PlacementDecision
from stratagem.strategies.tensor_parallel.apply import apply_tensor_parallel, grads_in_layout
from stratagem.strategies.tensor_parallel.data_axis import apply_replication
from stratagem.strategies.tensor_parallel.data_sharding import apply_data_sharding, check_data_sharding, data_dim
from stratagem.strategies.tensor_parallel.mesh import DeviceMesh, ParameterLayout
from stratagem.strategies.worker_group import techniques as in_order
from stratagem.strategies.worker_group.techniques import Removable, Technique


@dataclass(kw_only=True)
class Placing:
    """The model as the techniques leave it, and what each hands the ones after it."""

    model: nn.Module
    """The user's model, its parameters replaced in place."""
    mesh: DeviceMesh
    """The layout map's mesh."""
    torch_mesh: Any
    """torch's DeviceMesh of the same shape and axis names, over the worker group."""
    layouts: Sequence[ParameterLayout]
    """Every parameter's layout, checked (`mesh.resolve_layouts`, `styles.check_splits`)."""
    weight: Callable[[], float]
    """This model group's share of the global batch (or of the declared loss weights), read at each backward."""
    parameters_mesh: Any = None
    """torch's DeviceMesh the parameters are DTensors of, set by the split (what hooks on the model must use)."""
    sharded_along_data: frozenset[str] = frozenset()
    """The names of the parameters data sharding took: replication leaves them to it."""
    parts: list[Removable] = field(default_factory=list)
    """What the techniques left on the model, taken off at the strategy's close."""


def _tensor_parallel(placing: Placing) -> None:
    # The whole mesh where a layout names `data`: FSDP2 shards along it DTensors of the mesh it is given, and every
    # parameter must be of that one mesh (clip_grad_norm_ stacks their norms: data_sharding.py). Otherwise the
    # `model` axis alone, as before data sharding: on the 2-D mesh the MLP benchmark's ranks peaked 16 MiB higher
    # (312 MiB for 296, benchmarks/tensor_parallel_memory.py, tp2x2), for no use.
    on_data = any("data" in layout.layout for layout in placing.layouts)
    placing.parameters_mesh = placing.torch_mesh if on_data else placing.torch_mesh["model"]
    made = apply_tensor_parallel(placing.model, placing.layouts, placing.parameters_mesh)
    # Each gradient into its parameter's placement as it is accumulated; a parameter data sharding then replaces
    # leaves its hook behind on the old tensor, never called again (FSDP2 redistributes that gradient itself).
    placing.parts.extend(grads_in_layout(list(made.values())))


def _data_sharding(placing: Placing) -> None:
    done = apply_data_sharding(placing.model, placing.torch_mesh, placing.layouts, placing.weight)
    placing.sharded_along_data = done.names
    placing.parts.append(done)


def _replication(placing: Placing) -> None:
    summed = apply_replication(placing.model, placing.torch_mesh, placing.sharded_along_data, placing.weight)
    if summed is not None:
        placing.parts.append(summed)


def _check_data_sharding(placing: Placing) -> None:
    check_data_sharding(placing.layouts, placing.mesh)


TECHNIQUES: tuple[Technique[Placing], ...] = (
    Technique(name="tensor parallel", axes=("model",), apply=_tensor_parallel),
    Technique(name="data sharding", axes=("data",), apply=_data_sharding, check=_check_data_sharding),
    Technique(name="replication", axes=("data",), apply=_replication),
)
"""What TensorParallelStrategy applies, in order (the module docstring gives the reason for each place)."""


def check_techniques(placing: Placing, techniques: Sequence[Technique[Placing]] = TECHNIQUES) -> None:
    """Each applicable technique's check of the layouts, in order, before anything is placed."""
    in_order.check_techniques(techniques, placing, placing.mesh.axis_names)


def apply_techniques(
    placing: Placing, techniques: Sequence[Technique[Placing]] = TECHNIQUES
) -> dict[int, nn.Parameter]:
    """Applies each technique whose axes the mesh has, in order; returns the id of each parameter of the model as
    it was built to the parameter that replaced it (what `clone_optimizer` needs), tied ones under each name."""
    before = {name: id(p) for name, p in placing.model.named_parameters(remove_duplicate=False)}
    in_order.apply_techniques(techniques, placing, placing.mesh.axis_names)
    after = dict(placing.model.named_parameters(remove_duplicate=False))
    return {old: after[name] for name, old in before.items()}


def techniques_decision(
    mesh: DeviceMesh, layouts: Sequence[ParameterLayout], techniques: Sequence[Technique[Placing]] = TECHNIQUES
) -> PlacementDecision:
    """Which techniques apply on `mesh`, in their order, and over which axes (with how many parameters each data
    technique takes, once the layouts are resolved)."""
    on_data = sum(1 for layout in layouts if data_dim(layout) is not None)
    notes = {"data sharding": f" ({on_data} parameter(s))", "replication": " (every other parameter)"}
    return in_order.techniques_decision(
        techniques,
        mesh.axis_names,
        notes=notes if layouts else None,
        reason="applied in this order (tensor_parallel/techniques.py): the split first, since the data axis "
        "shards or sums the DTensors it makes (torchtitan's order: TP, then FSDP)",
    )
