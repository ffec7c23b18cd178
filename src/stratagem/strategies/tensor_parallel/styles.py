"""Which splits along `model` each module's forward honours, refused by module name before any parameter is placed
(a split along `data` is gathered whole before the forward: any module takes it).

The forward runs on DTensors (`apply.py`), so torch's sharding propagation gives every op of a split layer the
right inputs; what it cannot give is a module whose forward reshapes a split dimension into pieces the split
does not respect, or an op it has no rule for. Those are known per module type and refused here:

- `nn.Linear` (weight ``(out, in)``), transformers' `Conv1D` (weight ``(in, out)``) and `nn.Embedding`
  (weight ``(rows, features)``) honour a split of either dimension and of their bias;
- an `nn.Embedding` that renormalises rows (`max_norm`) or has sparse gradients is refused: both act on the whole
  table outside the ops DTensor propagates;
- any other module type with a split parameter is refused ("not supported yet"), naming it;
- an attention module (one with `num_heads`, `n_head` or `num_attention_heads`) whose split parameters would
  cut a head in two: its forward views the projection as ``(heads, head_dim)``, which needs whole heads per worker;
- a model whose attention runs a fused kernel (transformers' ``attn_implementation="sdpa"`` and others) is
  refused: DTensor has no rule for the CPU flash-attention kernel; ``"eager"`` runs the same attention in ops it
  has.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from stratagem.errors import InputError
from stratagem.strategies.tensor_parallel.mesh import DeviceMesh, ParameterLayout

HEAD_ATTRIBUTES = ("num_heads", "n_head", "num_attention_heads")


def style_of(module: nn.Module) -> str | None:
    """The name of the module kind whose splits are known, or None for a module not supported yet."""
    if isinstance(module, nn.Linear):
        return "Linear"
    if type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers."):
        return "Conv1D"
    if isinstance(module, nn.Embedding):
        return "Embedding"
    return None


def check_splits(model: nn.Module, layouts: Iterable[ParameterLayout], mesh: DeviceMesh) -> dict[str, str]:
    """Refuses, naming the module and why, a split layout that a module's forward cannot honour; returns the
    module kind of every split parameter's names."""
    owners = {f"{prefix}.{name}" if prefix else name: module
              for prefix, module in model.named_modules(remove_duplicate=False)
              for name, _ in module.named_parameters(recurse=False, remove_duplicate=False)}  # fmt: skip
    # Along `model` only: a parameter sharded along `data` is gathered whole before its module's forward
    # (data_sharding.py), so every module honours it.
    split = [layout for layout in layouts if "model" in layout.layout]
    kinds: dict[str, str] = {}
    if split:
        _check_attention_kernel(model)
    for layout in split:
        for name in layout.names:
            module = owners[name]
            owner = name.rpartition(".")[0] or "(the model)"
            kind = style_of(module)
            if kind is None:
                raise InputError(
                    f"Splitting {name} is not supported yet: its module {owner} is a {type(module).__name__}, whose "
                    f"forward stratagem has not checked under a split. Received: {layout.key!r} -> {layout.layout}. "
                    "Replicate it (a key that does not match it), or split the Linear, Conv1D or Embedding layers."
                )
            if kind == "Embedding" and (module.max_norm is not None or module.sparse):
                why = (
                    "renormalises its rows in place (max_norm)"
                    if module.max_norm is not None
                    else "has sparse gradients"
                )
                raise InputError(
                    f"The Embedding {owner} {why}, which a split table cannot honour. Received: {layout.key!r} -> "
                    f"{layout.layout}. Replicate it, or build it with max_norm=None and sparse=False."
                )
            kinds[name] = kind
    for prefix, module in model.named_modules():
        heads = next((getattr(module, a) for a in HEAD_ATTRIBUTES if isinstance(getattr(module, a, None), int)), None)
        if heads is None:
            continue
        for layout in split:
            if not any(n.startswith(prefix + ".") for n in layout.names):
                continue
            for axis in {a for a in layout.layout if a == "model"}:
                size = mesh.axis_size(axis)
                if heads % size:
                    raise InputError(
                        f"The attention module {prefix} has {heads} heads, which {size} workers of axis {axis!r} cannot "
                        f"split into whole heads: its forward views {layout.names[0]}'s output as (heads, head_dim). "
                        f"Received: {layout.key!r} -> {layout.layout}, mesh {mesh.shape} {mesh.axis_names}. Use a number "
                        f"of {axis!r} workers that divides {heads}, or replicate {prefix}'s parameters."
                    )
    return kinds


def _check_attention_kernel(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    kernel = getattr(config, "_attn_implementation", None)
    if kernel not in (None, "eager"):
        raise InputError(
            f"{type(model).__name__} runs its attention with attn_implementation={kernel!r}, a fused kernel that "
            "DTensor cannot split yet. Received: a split layout over this model. Build it with "
            "attn_implementation='eager' (the same attention, in ops DTensor has rules for)."
        )
