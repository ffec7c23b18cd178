"""The technique ShardedStrategy applies to a model, over the one `data` axis of its worker group's mesh.

ShardedStrategy is its record plus this table (`worker_group/techniques.py`: the machinery every strategy of
techniques shares), of one technique:

1. data sharding (`data`), `apply_sharding`: FSDP2's `fully_shard` on each unit of the cut, innermost first, then
   the root (`units.apply_cut`; stage 2 keeps a unit gathered from forward to backward), and every unit's
   gradients reduce-scattered as a SUM, each rank's pre-scaled by its share of the global batch
   (`weighting.weigh_gradients`), which is what makes the result one device's.

What comes before it (the checks, BatchNorm layers converted, the cut, the memory plan against the limit) and after
it (the shards checked across ranks, the optimizer cloned over the shards) is the strategy's own, in the order
`strategy.py` lists. A model built inside `strategy.scope()` is cut and `fully_shard`-ed there (`shard_cut`, the
same call), and its `distribute` runs the table with `Sharding.sharded_already` set.

Example:
    >>> [(t.name, t.axes) for t in TECHNIQUES]
    [('data sharding', ('data',))]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stratagem.diagnose import PlacementDecision
from stratagem.strategies.sharded.units import UnitCut, apply_cut, sharded_units
from stratagem.strategies.sharded.weighting import weigh_gradients
from stratagem.strategies.worker_group.techniques import ONE_DATA_AXIS, Technique, techniques_decision

if TYPE_CHECKING:
    from stratagem.collective.flight import FlightRecord
    from stratagem.shm.sums import SharedMemoryGroup
    from stratagem.strategies.sharded.reduce_scatter import WeightedReduceScatter

MixedPrecision = tuple[torch.dtype | None, torch.dtype | None]
"""``(param_dtype, reduce_dtype)`` of FSDP2's `MixedPrecisionPolicy`."""


@dataclass(kw_only=True)
class Sharding:
    """ShardedStrategy's model as its technique leaves it, and what the strategy reads from it after."""

    model: nn.Module
    """The model on this worker's device, its BatchNorm layers converted; sharded in place."""
    cut: UnitCut
    """Its units (`units.cut_model`)."""
    mesh: Any
    """torch's 1-D DeviceMesh over the worker group, its one axis named `data` (`WorkerGroup.device_mesh()`)."""
    stage: int
    """3: each unit gathered for its forward and again for its backward; 2: kept from forward to backward."""
    mp: MixedPrecision
    """FSDP2's mixed precision, ``(param_dtype, reduce_dtype)``."""
    shared: SharedMemoryGroup | None
    """This host's shared-memory group for the units' collectives (transport.py), or None: the process group."""
    step: Callable[[], int]
    """The step the collectives' errors name."""
    flight: FlightRecord | None
    """The worker's record of its last collectives, which the units' join."""
    sharded_already: bool = False
    """Built inside `scope()`: `fully_shard` ran there, on meta (scope.py)."""
    units: list[nn.Module] = field(default_factory=list)
    """One module per FSDP2 unit, the root first (`units.sharded_units`), set by the technique."""
    comm: WeightedReduceScatter | None = None
    """The units' weighted reduce-scatter, whose weight `run` sets; set by the technique."""


def shard_cut(model: nn.Module, cut: UnitCut, *, mesh: Any, stage: int, mp: MixedPrecision) -> None:
    """`fully_shard` on every unit of `cut`, then the root, at `stage` (`units.apply_cut`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy  # FSDP2, imported when a model is sharded

    param_dtype, reduce_dtype = mp
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    apply_cut(model, cut, mesh=mesh, reshard_after_forward=stage == 3, mp_policy=mp_policy)


def apply_sharding(placing: Sharding) -> None:
    """The model's units sharded along `data` (unless `scope()` did it) and their gradients reduce-scattered as a
    weighted SUM."""
    if not placing.sharded_already:
        shard_cut(placing.model, placing.cut, mesh=placing.mesh, stage=placing.stage, mp=placing.mp)
    placing.units = sharded_units(placing.model, placing.cut)
    placing.comm = weigh_gradients(placing.units, placing.shared, placing.step, placing.flight)


TECHNIQUES: tuple[Technique[Sharding], ...] = (
    Technique(name="data sharding", axes=ONE_DATA_AXIS, apply=apply_sharding),
)
"""What ShardedStrategy applies, in order: its one technique."""


def techniques_line() -> PlacementDecision:
    """`explain()`'s `techniques` line: the table's techniques, in order, and why."""
    return techniques_decision(
        TECHNIQUES,
        ONE_DATA_AXIS,
        reason="ShardedStrategy's techniques (sharded/techniques.py): FSDP2's fully_shard per unit, then the root, on "
        "the worker group's one 'data' axis; each rank's gradients pre-scaled by its share of the global batch, then "
        "reduce-scattered",
    )
