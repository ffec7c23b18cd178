"""A memory plan held against the process's limit before step 1: refused, naming a configuration that fits.

ShardedStrategy plans its peak per rank (`sharded/memory.py`); MultiWorkerMirroredStrategy's plan is a whole
copy of the training state per process (`replicated_plan`). Either is compared, in `distribute`, with the
headroom of the tightest limit on the process (`diagnose.memory_limit`: cgroup v2 or v1, RLIMIT_AS, RLIMIT_DATA,
a GPU's free memory); over it, `distribute` raises an `InputError` with the plan, the limit and the first of
ShardedStrategy's stages and worker counts whose plan fits, instead of training until the kernel kills a worker.

    >>> check_plan_fits(900 << 20, MemoryLimit(limit=1 << 30, used=300 << 20, source="cgroup v1 /job"),
    ...                 strategy="MultiWorkerMirroredStrategy", alternatives=lambda room: [])  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from stratagem.diagnose.memory_limit import MemoryLimit
from stratagem.errors import InputError
from stratagem.strategies.sharded.memory import plan_memory, show_bytes

if TYPE_CHECKING:
    from stratagem.strategies.sharded.units import UnitCut


@dataclass(frozen=True, kw_only=True)
class Alternative:
    """A configuration and its plan's peak per process."""

    strategy: str
    """E.g. "ShardedStrategy(stage=3) on 4 workers"."""
    total: int


def check_plan_fits(
    total: int | None,
    limit: MemoryLimit,
    *,
    strategy: str,
    alternatives: Callable[[], Iterable[Alternative]],
    held: int = 0,
) -> None:
    """Refuses a plan of `total` bytes per process (over its RSS before the model) beyond `limit`'s headroom;
    `held`: what of the plan the process holds already and the limit counts as used (the user's model, built).
    `alternatives()` lists the configurations to try; the first that fits is named. Nothing is refused without a
    plan or a limit."""
    room = limit.headroom
    if total is None or room is None or total - held <= room:
        return
    fits = next((a for a in alternatives() if a.total - held <= room), None)
    fix = (
        f"Use {fits.strategy} (its plan: {show_bytes(fits.total)} per process)"
        if fits is not None
        else "No stage or worker count tried fits: use more workers"
    )
    raise InputError(
        f"{strategy}'s memory plan needs {show_bytes(total)} per process over its memory before the model "
        f"({show_bytes(total - held)} beyond what it holds now), but this process has {show_bytes(room)} left under "
        f"its limit, so training would be killed by the kernel. Received: plan "
        f"{show_bytes(total)}, limit {show_bytes(limit.limit or 0)} ({limit.source}) with {show_bytes(limit.used)} "
        f"in use. {fix}, or raise the limit."
    )


def sharded_alternatives(
    params: list[nn.Parameter],
    optimizer: torch.optim.Optimizer | None,
    *,
    world_size: int,
    stage: int | None,
    largest_unit_bytes: int,
    num_units: int,
    transport_per_worker: int = 0,
    root_bytes: int = 0,
    activations: int = 0,
    cut_at: Callable[[int], UnitCut] | None = None,
    batch_check_copy: bool = False,
) -> list[Alternative]:
    """ShardedStrategy's plans, best first: stage 3 (and 2) at `world_size` (the ones other than `stage`), then
    stage 3 at up to 8x the workers. `transport_per_worker`: the shared-memory slot per rank (+1 for the result);
    `activations`: this rank's at `world_size`, which n workers divide as they divide the global batch (a rank's
    part holds about world_size / n of this one's examples). `cut_at(stage)`: the units the strategy would cut at
    that stage (stage 2 merges small blocks, `sharded/units.py`), whose largest unit, count and root replace the
    three figures given; `batch_check_copy`: as `plan_memory`'s (the strategy's batch check is always on)."""
    tried: list[Alternative] = []
    configurations = [(s, world_size) for s in (3, 2) if s != stage]
    configurations += [(3, n) for n in range(world_size + 1, 8 * world_size + 1)]
    for s, n in configurations:
        cut = None if cut_at is None else cut_at(s)
        plan = plan_memory(
            params, optimizer, rank=0, world_size=n, stage=s,
            largest_unit_bytes=largest_unit_bytes if cut is None else cut.largest_unit_bytes,
            num_units=num_units if cut is None else len(cut.groups),
            transport_bytes=(n + 1) * transport_per_worker,
            root_bytes=root_bytes if cut is None else cut.root_bytes,
            activations=activations * world_size // n, batch_check_copy=batch_check_copy,
        )  # fmt: skip
        if plan.total is not None:
            where = f"on {n} workers" if n != world_size else "on these workers"
            tried.append(Alternative(strategy=f"ShardedStrategy(stage={s}) {where}", total=plan.total))
    return tried


@dataclass(frozen=True, kw_only=True)
class ReplicatedMemoryPlan:
    """MultiWorkerMirroredStrategy's bytes per process: a whole copy of the training state, and the user's model,
    which it keeps beside its replica (`total` is a lower bound: the allocator's slack and activations not counted).

    Example:
        >>> strategy.memory_plan(model, optimizer).total                     # doctest: +SKIP
    """

    user_model: int
    """The model as the user built it, kept beside the replica."""
    parameters: int
    """The replica's parameters."""
    gradients: int
    optimizer_state: int | None
    """None: an optimizer the plan does not know."""
    optimizer_temporaries: int
    buffers: int
    """The shared-memory file the gradients are summed through (0: the process group)."""

    @property
    def total(self) -> int | None:
        if self.optimizer_state is None:
            return None
        state = self.parameters + self.gradients + self.optimizer_state
        return self.user_model + state + self.optimizer_temporaries + self.buffers


def replicated_plan(
    params: list[nn.Parameter], optimizer: torch.optim.Optimizer | None, *, buffers: int = 0
) -> ReplicatedMemoryPlan:
    """The plan of a whole copy per process (the sharded plan's formulas at one worker)."""
    one = plan_memory(params, optimizer, rank=0, world_size=1, stage=3, largest_unit_bytes=0, num_units=1)
    return ReplicatedMemoryPlan(
        user_model=one.unsharded_model,
        parameters=one.parameters,
        gradients=one.gradients,
        optimizer_state=one.optimizer_state,
        optimizer_temporaries=one.optimizer_temporaries,
        buffers=buffers,
    )
