"""What `TensorParallelStrategy.explain()` says: the mesh, each parameter's layout, and the redistributions a
step implies (by the module kind and the split dimension, as `styles.py` knows them)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from stratagem.diagnose import PlacementDecision
from stratagem.strategies.tensor_parallel.data_sharding import data_dim
from stratagem.strategies.tensor_parallel.mesh import DeviceMesh, ParameterLayout
from stratagem.strategies.tensor_parallel.techniques import techniques_decision

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


def layout_decisions(
    mesh: DeviceMesh, layouts: Sequence[ParameterLayout], step_bytes: str | None = None
) -> list[PlacementDecision]:
    """The mesh, the techniques in their order, the parameters split and replicated, the `model` axis's
    collectives of a step with their bytes (`step_bytes`: `StepBytes.summary()` of the step `memory_plan`
    measured, None before one), and on a `data` axis the gradient sum of the replicated parameters and the
    sharding of the others (with their elements per step)."""
    out = [
        PlacementDecision(
            subject="mesh",
            choice=f"{mesh.shape} {mesh.axis_names}",
            reason="the layout map's mesh" if mesh.axis_names != ("model",) else "one 'model' axis over every worker",
        )
    ]
    out.append(techniques_decision(mesh, layouts))  # every mesh: the split alone on one `model` axis
    if not layouts:
        return out
    split = [layout for layout in layouts if layout.is_split]
    replicated = len(layouts) - len(split)
    out.append(
        PlacementDecision(
            subject="layouts",
            choice=f"{len(split)} parameter(s) split, {replicated} replicated",
            reason="each parameter's first matching key of the layout map (details: layouts); a parameter no key "
            "matches is replicated, its gradient identical on every worker of the model axis with no collective, "
            "because DTensor's redistributions are deterministic",
        )
    )
    if mesh.axis_size("model") > 1:
        out.append(
            PlacementDecision(
                subject="model axis",
                choice=f"per step: {step_bytes}" if step_bytes is not None else "per step: not measured yet",
                reason="the collectives DTensor inserts along 'model' in one forward and backward (each split's "
                "kind: details' layouts), counted with the bytes this rank hands each (its part for an all-gather, "
                "its whole input otherwise) in memory_plan(example_inputs=...)'s measuring step"
                if step_bytes is not None
                else "their bytes follow the activations: call strategy.memory_plan(example_inputs=one global batch) "
                "on every worker after distribute to count them",
            )
        )
    if "data" in mesh.axis_names:
        model, data = mesh.axis_size("model"), mesh.axis_size("data")
        sharded = [layout for layout in layouts if data_dim(layout) is not None]
        # elements of this worker's `model` part of every gradient, to within a row of an uneven split
        local = {
            id(layout): math.prod(layout.shape) // (model if "model" in layout.layout else 1) for layout in layouts
        }
        summed = sum(n for key, n in local.items() if key not in {id(layout) for layout in sharded})
        out.append(
            PlacementDecision(
                subject="data axis",
                choice=f"all-reduce (SUM) of each replicated parameter's gradient across {data} data groups",
                reason=f"each group's gradient weighted by its share of the global batch, summed inside backward: "
                f"about {summed} elements per worker per step (x element size: {summed * 8} bytes in float64)",
            )
        )
        if sharded:
            gathered = sum(local[id(layout)] for layout in sharded)
            out.append(
                PlacementDecision(
                    subject="data sharding",
                    choice=f"{len(sharded)} parameter(s) sharded along 'data' (ZeRO-3, FSDP2): 1/{data} of each "
                    "model part, its gradient and optimizer state per worker",
                    reason="their layout names 'data'; each is all-gathered across 'data' for its module's forward "
                    "and again for its backward, and its gradient reduce-scattered (SUM, each group's weighted by its "
                    f"share): about {gathered} elements gathered twice and {gathered} reduce-scattered per worker "
                    "per step",
                )
            )
    return out


def layout_table(layouts: Sequence[ParameterLayout], kinds: Mapping[str, str]) -> str:
    """One line per parameter: its names, shape, layout, the key that matched, and what its split costs a step
    (`kinds`: the module kind of each split parameter's first name, from `styles.check_splits`)."""
    lines = []
    for layout in layouts:
        line = f"{' = '.join(layout.names)} {layout.shape}: {layout.layout}"
        if "model" in layout.layout:
            kind = kinds.get(layout.names[0], "?")
            line += f" (key {layout.key!r}; {kind}: {redistributions(kind, layout.layout.index('model'), len(layout.shape))})"
            line = line[:-1] + ("; sharded along 'data' (ZeRO-3))" if "data" in layout.layout else ")")
        elif layout.is_split:
            line += f" (key {layout.key!r}; sharded along 'data' (ZeRO-3), whole along 'model')"
        else:
            line += " replicated" + ("" if layout.key is None else f" (key {layout.key!r})")
        lines.append(line)
    return "\n".join(lines)


def redistributions(kind: str, dim: int, ndim: int = 2) -> str:
    """What a split of dimension `dim` of a `kind` module's weight costs per call (the `_COSTS` table); a bias
    (`ndim` 1) is split with its layer's output features."""
    if ndim == 1 and kind in ("Linear", "Conv1D"):
        return "bias split with the output features: no collective of its own"
    return _COSTS.get((kind, dim), "as DTensor's sharding propagation decides")
