"""What `TensorParallelStrategy.explain()` says: the mesh, each parameter's layout, and the redistributions a
step implies (by the module kind and the split dimension, as `styles.py` knows them)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from stratagem.diagnose import PlacementDecision
from stratagem.strategies.tensor_parallel.mesh import DeviceMesh, ParameterLayout

# What a split of (module kind, split dimension of the weight) costs per call of the layer: the collectives
# DTensor inserts, forward then backward. Linear's weight is (out, in); Conv1D's is (in, out).
_COSTS = {
    ("Linear", 0): "output features split: forward none (the output stays split until an op needs it whole: "
    "then an all-gather); backward an all-reduce of the input's gradient",
    ("Linear", 1): "input features split: forward an all-reduce of the partial output; backward none",
    ("Conv1D", 1): "output features split: forward none (the output stays split until an op needs it whole: "
    "then an all-gather); backward an all-reduce of the input's gradient",
    ("Conv1D", 0): "input features split: forward an all-reduce of the partial output; backward none",
    ("Embedding", 0): "rows (vocabulary) split: forward an all-reduce of the masked lookups; used as a tied output "
    "layer, the logits come out split along the vocabulary and are all-gathered whole",
    ("Embedding", 1): "features split: forward an all-gather of the looked-up features",
}


def layout_decisions(mesh: DeviceMesh, layouts: Sequence[ParameterLayout]) -> list[PlacementDecision]:
    """The mesh, the parameters split and replicated, and the data axis's gradient sum (with its bytes per step)."""
    out = [
        PlacementDecision(
            subject="mesh",
            choice=f"{mesh.shape} {mesh.axis_names}",
            reason="the layout map's mesh" if mesh.axis_names != ("model",) else "one 'model' axis over every worker",
        )
    ]
    if not layouts:
        return out
    split = [layout for layout in layouts if layout.is_split]
    replicated = len(layouts) - len(split)
    out.append(
        PlacementDecision(
            subject="layouts",
            choice=f"{len(split)} parameter(s) split along 'model', {replicated} replicated",
            reason="each parameter's first matching key of the layout map (details: layouts); a parameter no key "
            "matches is replicated, its gradient identical on every worker of the model axis with no collective, "
            "because DTensor's redistributions are deterministic",
        )
    )
    if "data" in mesh.axis_names:
        model = mesh.axis_size("model")
        local = sum(
            math.prod(layout.shape) // (model if layout.is_split else 1) for layout in layouts
        )  # elements of this worker's part of every gradient, to within a row of an uneven split
        out.append(
            PlacementDecision(
                subject="data axis",
                choice=f"all-reduce (SUM) of each gradient's local part across {mesh.axis_size('data')} data groups",
                reason=f"each group's gradient weighted by its share of the global batch, summed inside backward: "
                f"about {local} elements per worker per step (x element size: {local * 8} bytes in float64)",
            )
        )
    return out


def layout_table(layouts: Sequence[ParameterLayout], kinds: Mapping[str, str]) -> str:
    """One line per parameter: its names, shape, layout, the key that matched, and what its split costs a step
    (`kinds`: the module kind of each split parameter's first name, from `styles.check_splits`)."""
    lines = []
    for layout in layouts:
        line = f"{' = '.join(layout.names)} {layout.shape}: {layout.layout}"
        if layout.is_split:
            dim = next(i for i, a in enumerate(layout.layout) if a is not None)
            kind = kinds.get(layout.names[0], "?")
            line += f" (key {layout.key!r}; {kind}: {redistributions(kind, dim)})"
        else:
            line += " replicated" + ("" if layout.key is None else f" (key {layout.key!r})")
        lines.append(line)
    return "\n".join(lines)


def redistributions(kind: str, dim: int) -> str:
    """What a split of dimension `dim` of a `kind` module's weight costs per call (the `_COSTS` table)."""
    return _COSTS.get((kind, dim), "as DTensor's sharding propagation decides")
