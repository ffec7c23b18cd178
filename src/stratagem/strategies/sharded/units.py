"""How a model is cut into the units that `fully_shard` gathers one at a time, and the cut applied.

A unit's parameters are all-gathered before its forward and freed after it (stage 3) or after its
backward (stage 2), so the gathered working set at any moment is about one unit, not the model.
By default every child of a `ModuleList` or `Sequential` (the repeated blocks of a transformer, the
layers of a Sequential MLP, a ResNet stage's blocks) is a unit, and the root holds what is left
(embeddings, heads); a policy chooses otherwise: module classes, or a callable of a module. The
units are sharded first and the root last, as torchtitan's `apply_fsdp` does, because `fully_shard`
on the root takes only the parameters no unit below it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stratagem.diagnose import PlacementDecision
from stratagem.errors import InputError
from stratagem.strategies.sharded.memory import show_bytes

UnitPolicy = Callable[[nn.Module], bool] | Sequence[type] | None
"""None (each block of a ModuleList or Sequential), module classes, or a callable of a module."""


@dataclass(frozen=True, kw_only=True)
class UnitCut:
    """The units of a model, in the order `fully_shard` is applied (the root last)."""

    units: tuple[nn.Module, ...]
    """The modules sharded as units of their own (the root not included)."""
    names: tuple[str, ...]
    """Each unit's qualified name in the model."""
    how: str
    """How they were chosen, in words."""
    largest_unit_bytes: int
    """Bytes of the largest gathered unit, the root's own parameters included."""
    model_bytes: int
    """Bytes of every parameter of the model."""
    root_bytes: int = 0
    """Bytes of the root's own parameters, those no unit holds (embeddings, tied heads)."""
    suggestion: str = "YourBlock"
    """A module class worth making a unit (named in the warning for a whole-model unit)."""

    @property
    def whole_model(self) -> bool:
        """True when the root is the only unit: every forward gathers the whole model."""
        return not self.units

    def decision(self) -> PlacementDecision:
        if self.whole_model:
            return PlacementDecision(
                subject="sharding units",
                choice="the whole model as one unit",
                reason=f"{self.how}; the gathered peak is the unsharded model ({show_bytes(self.model_bytes)})",
            )
        shown = ", ".join(self.names[:3]) + (", ..." if len(self.names) > 3 else "")
        return PlacementDecision(
            subject="sharding units",
            choice=f"{len(self.units)} units and the root ({shown})",
            reason=f"{self.how}; the largest gathered unit holds {show_bytes(self.largest_unit_bytes)} "
            f"of the model's {show_bytes(self.model_bytes)}",
        )

    def warning(self) -> str | None:
        """What to tell the user when sharding cannot lower the peak (None: it can)."""
        if not self.whole_model:
            return None
        return (
            "ShardedStrategy shards the whole model as one unit, so every forward gathers all of it: the peak "
            f"working set is the unsharded model ({show_bytes(self.model_bytes)}) on every rank. Received: {self.how}. "
            f"Cut it into blocks with units=(BlockClass,) or a callable, e.g. units=({self.suggestion},)."
        )


def cut_model(model: nn.Module, policy: UnitPolicy) -> UnitCut:
    """The units of `model` under `policy` (see the module docstring); refuses a policy of another kind."""
    if policy is None:
        units = _blocks(model)
        how = "each child of a ModuleList or Sequential (the default)"
        if not units:
            how = "the default found no ModuleList or Sequential of blocks with parameters"
    elif callable(policy) and not isinstance(policy, type):
        units = [m for name, m in model.named_modules() if name and _has_parameters(m) and policy(m)]
        how = "the modules the given policy chose"
    elif isinstance(policy, (tuple, list)) and policy and all(isinstance(c, type) for c in policy):
        classes = tuple(policy)
        units = [m for name, m in model.named_modules() if name and _has_parameters(m) and isinstance(m, classes)]
        how = f"every {' or '.join(c.__name__ for c in classes)}"
    else:
        raise InputError(
            "units must be None (each block of a ModuleList or Sequential), a tuple of module classes, or a "
            f"callable of a module returning True for a unit. Received: units={policy!r}. "
            "Pass e.g. units=(TransformerBlock,)."
        )
    names = {id(m): n for n, m in model.named_modules()}
    own = {id(p) for u in units for p in u.parameters()}
    root_bytes = sum(_bytes(p) for p in model.parameters() if id(p) not in own)
    # A nested unit is gathered inside its parent's own gather only for the parent's direct parameters.
    unit_bytes = [_own_bytes(u, units) for u in units]
    return UnitCut(
        units=tuple(units),
        names=tuple(names[id(u)] for u in units),
        how=how if units or policy is None else f"{how}: none",
        largest_unit_bytes=root_bytes + max(unit_bytes, default=0),
        model_bytes=sum(_bytes(p) for p in model.parameters()),
        root_bytes=root_bytes,
        suggestion=_largest_child_class(model),
    )


def apply_cut(model: nn.Module, cut: UnitCut, **fsdp: Any) -> nn.Module:
    """`fully_shard` on every unit, innermost first, then on the root; returns the root (sharded in place)."""
    from torch.distributed.fsdp import fully_shard

    depth = {id(m): n.count(".") + 1 for n, m in model.named_modules() if n}
    for unit in sorted(cut.units, key=lambda u: -depth[id(u)]):
        fully_shard(unit, **fsdp)
    fully_shard(model, **fsdp)
    return model


def _blocks(model: nn.Module) -> list[nn.Module]:
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(module, (nn.ModuleList, nn.Sequential)) and _has_parameters(child):
                found.append(child)  # a block: its own insides are gathered with it
            else:
                visit(child)

    visit(model)
    return found


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _own_bytes(unit: nn.Module, units: Sequence[nn.Module]) -> int:
    nested = {id(p) for u in units if u is not unit and _contains(unit, u) for p in u.parameters()}
    return sum(_bytes(p) for p in unit.parameters() if id(p) not in nested)


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _largest_child_class(model: nn.Module) -> str:
    best, best_bytes = "YourBlock", 0
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) or module is model:
            continue
        size = sum(_bytes(p) for p in module.parameters())
        if 0 < size < sum(_bytes(p) for p in model.parameters()) and size > best_bytes:
            best, best_bytes = type(module).__name__, size
    return best


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
