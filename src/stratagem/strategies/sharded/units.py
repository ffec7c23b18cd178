"""How a model is cut into the units that `fully_shard` gathers one at a time, and the cut applied.

A unit's parameters are all-gathered before its forward and freed after it (stage 3) or after its
backward (stage 2), so the gathered working set at any moment is about one unit, not the model.
By default every child of a `ModuleList` or `Sequential` (the repeated blocks of a transformer, the
layers of a Sequential MLP, a ResNet stage's blocks) is a unit, and the root holds what is left
(embeddings, heads); a policy chooses otherwise: module classes, or a callable of a module. The
units are sharded first and the root last, as torchtitan's `apply_fsdp` does, because `fully_shard`
on the root takes only the parameters no unit below it holds.

Stage 2's default merges small blocks. Every unit costs FSDP2 the same Python work per step whatever its size
(hooks around its forward and backward, one all-gather, one reduce-scatter, copies in and out of their buffers):
on a model of many small blocks that work, not the bytes, is what the step pays. At stage 2 every unit stays
gathered from forward to backward anyway, so a larger unit adds only its unsharded gradients and their
reduce-scatter input at its backward. So consecutive blocks of one `ModuleList` or `Sequential` share one unit
(`fully_shard([block_i, ..., block_j])`, FSDP2's grouping: one gather and one reduce-scatter for them all) while it
stays within `MERGE_UP_TO` bytes, and a model of at most that many bytes is one unit, the root alone. A block of
more stays a unit by itself, so a model whose blocks are larger (the ones sharding is for) is cut as before; stage 3,
which gathers a unit for its forward and again for its backward to bound the peak, keeps a unit per block.

Merging is exact. The reduce-scatter of a merged unit starts when the gradient reaches the input of its first
block to run, through the autograd node FSDP2 puts there when that block's forward starts. The autograd engine
runs, of the nodes ready, the one created last (the largest sequence number), and no node waits on one created
before it, so every node the later blocks made, their parameters' gradient accumulation included, has run by then,
whether the blocks form a chain or run side by side on one input (`tests/test_sharded_units.py`).
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
"""None (each block of a ModuleList or Sequential; at stage 2 small consecutive ones merged), module classes, or a
callable of a module."""

MERGE_UP_TO = 8 * 2**20
"""Stage 2's default: consecutive blocks share a unit while it holds at most this many bytes of parameters. Two
units of this size cost about one's hooks and collectives (FSDP2's per-unit work on the CPU is about what copying
a few MiB costs), and at stage 2 a merged unit raises the peak by at most twice this (its unsharded gradients and
their reduce-scatter input), a few percent of a model large enough to need sharding."""


@dataclass(frozen=True, kw_only=True)
class UnitCut:
    """The units of a model, in the order `fully_shard` is applied (the root last)."""

    groups: tuple[tuple[nn.Module, ...], ...]
    """The units, in the model's order, the root not included: each one module, or consecutive blocks of one
    ModuleList or Sequential sharded as one unit (`fully_shard([...])`)."""
    names: tuple[str, ...]
    """Each unit's qualified name in the model (`transformer.h.0-3` for blocks 0 to 3 merged)."""
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
    merge_up_to: int = 0
    """Consecutive blocks were merged into units of at most this many bytes (0: each block its own unit)."""

    @property
    def units(self) -> tuple[nn.Module, ...]:
        """Every module sharded as a unit or as part of one, in order (the root not included)."""
        return tuple(m for group in self.groups for m in group)

    @property
    def whole_model(self) -> bool:
        """True when the root is the only unit: every forward gathers the whole model."""
        return not self.groups

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
            choice=f"{len(self.groups)} units and the root ({shown})",
            reason=f"{self.how}; the largest gathered unit holds {show_bytes(self.largest_unit_bytes)} "
            f"of the model's {show_bytes(self.model_bytes)}",
        )

    def warning(self) -> str | None:
        """What to tell the user when sharding cannot lower the peak (None: it can, or stage 2 chose one unit)."""
        if not self.whole_model or self.model_bytes <= self.merge_up_to:
            return None
        return (
            "ShardedStrategy shards the whole model as one unit, so every forward gathers all of it: the peak "
            f"working set is the unsharded model ({show_bytes(self.model_bytes)}) on every rank. Received: {self.how}. "
            f"Cut it into blocks with units=(BlockClass,) or a callable, e.g. units=({self.suggestion},)."
        )


def cut_model(model: nn.Module, policy: UnitPolicy, *, stage: int = 3, merge_up_to: int = MERGE_UP_TO) -> UnitCut:
    """The units of `model` under `policy` at `stage` (see the module docstring); refuses a policy of another kind.

    `merge_up_to`: the bytes up to which stage 2's default merges consecutive blocks (the module's `MERGE_UP_TO`)."""
    merge = merge_up_to if policy is None and stage == 2 else 0
    groups: list[list[nn.Module]] = []
    if policy is None:
        found = _blocks(model)
        units = [m for group in found for m in group]
        how = "each child of a ModuleList or Sequential (the default)"
        if stage == 3 and units:
            how = "each child of a ModuleList or Sequential (the default: stage 3's gathered peak is about one unit)"
        if not units:
            how = "the default found no ModuleList or Sequential of blocks with parameters"
        if merge:
            groups, how = _merged(model, found, merge, how)
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
    if not merge:
        groups = [[u] for u in units]
    units = [m for group in groups for m in group]
    names = {id(m): n for n, m in model.named_modules()}
    own = {id(p) for u in units for p in u.parameters()}
    root_bytes = sum(_bytes(p) for p in model.parameters() if id(p) not in own)
    # A nested unit is gathered inside its parent's own gather only for the parent's direct parameters.
    unit_bytes = [sum(_own_bytes(u, units) for u in group) for group in groups]
    return UnitCut(
        groups=tuple(tuple(group) for group in groups),
        names=tuple(_group_name([names[id(u)] for u in group]) for group in groups),
        how=how if units or policy is None else f"{how}: none",
        largest_unit_bytes=root_bytes + max(unit_bytes, default=0),
        model_bytes=sum(_bytes(p) for p in model.parameters()),
        root_bytes=root_bytes,
        suggestion=_largest_child_class(model),
        merge_up_to=merge,
    )


def apply_cut(model: nn.Module, cut: UnitCut, **fsdp: Any) -> nn.Module:
    """`fully_shard` on every unit, innermost first, then on the root; returns the root (sharded in place)."""
    from torch.distributed.fsdp import fully_shard

    depth = {id(m): n.count(".") + 1 for n, m in model.named_modules() if n}
    for group in sorted(cut.groups, key=lambda g: -depth[id(g[0])]):
        # Several blocks: one FSDP2 unit for them all, one all-gather and one reduce-scatter (FSDP2's grouping).
        fully_shard(group[0] if len(group) == 1 else list(group), **fsdp)
    fully_shard(model, **fsdp)
    return model


def sharded_units(model: nn.Module, cut: UnitCut) -> list[nn.Module]:
    """One module per FSDP2 unit of `model` after `apply_cut(model, cut)`, the root first: the modules whose
    collectives the strategy sets (the modules of a merged unit share its collectives; the first stands for them)."""
    return [model, *(group[0] for group in cut.groups)]


def _blocks(model: nn.Module) -> list[list[nn.Module]]:
    """The blocks of the default cut, grouped by the ModuleList or Sequential that holds them, in order."""
    found: list[list[nn.Module]] = []

    def visit(module: nn.Module) -> None:
        siblings: list[nn.Module] = []
        found.append(siblings)  # before any nested container's blocks: the model's order
        for child in module.children():
            if isinstance(module, (nn.ModuleList, nn.Sequential)) and _has_parameters(child):
                siblings.append(child)  # a block: its own insides are gathered with it
            else:
                visit(child)

    visit(model)
    return [siblings for siblings in found if siblings]


def _merged(
    model: nn.Module, found: list[list[nn.Module]], merge_up_to: int, how: str
) -> tuple[list[list[nn.Module]], str]:
    """Stage 2's default: the whole model as one unit when it holds at most `merge_up_to` bytes, else consecutive
    blocks of each container merged while a unit stays within `merge_up_to` (a larger block stays alone); with
    `how` said of the blocks found, the units and how they were chosen."""
    limit = show_bytes(merge_up_to)
    why = "stage 2 keeps every unit gathered from forward to backward, so fewer units save FSDP2's per-unit work"
    model_bytes = sum(_bytes(p) for p in model.parameters())
    if model_bytes <= merge_up_to:
        return [], f"stage 2's default: the model ({show_bytes(model_bytes)}) is within {limit}, so one unit; {why}"
    if not found:
        return [], how
    groups: list[list[nn.Module]] = []
    for siblings in found:
        current: list[nn.Module] = []
        held = 0
        for block in siblings:
            size = sum(_bytes(p) for p in block.parameters())
            if current and held + size > merge_up_to:
                groups.append(current)
                current, held = [], 0
            current.append(block)
            held += size
        if current:
            groups.append(current)
    merged = sum(len(g) for g in groups) - len(groups)
    if not merged:
        return groups, f"each child of a ModuleList or Sequential (stage 2's default: none within {limit} to merge)"
    return groups, (
        f"each child of a ModuleList or Sequential, consecutive ones merged into units of at most {limit} "
        f"(stage 2's default: {merged + len(groups)} blocks in {len(groups)} units); {why}"
    )


def _group_name(names: list[str]) -> str:
    """`h.0` for one block; `h.0-3` for blocks 0 to 3 of `h` merged."""
    if len(names) == 1:
        return names[0]
    return f"{names[0]}-{names[-1].rpartition('.')[2]}"


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
