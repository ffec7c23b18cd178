"""`RankMemory`, ShardedStrategy's memory part: the plan of what this rank will hold, the activations it counts,
and the refusal of a plan over the process's memory limit before anything is sharded (the arithmetic is
`memory.py`'s, the limit `memory_fit.py`'s)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stratagem.data.split import replica_part
from stratagem.diagnose.memory_limit import read_memory_limit
from stratagem.errors import InputError
from stratagem.strategies.activation_memory import ActivationEstimate, plan_activations
from stratagem.strategies.memory_fit import check_plan_fits, sharded_alternatives
from stratagem.strategies.sharded.memory import MemoryPlan, plan_memory
from stratagem.strategies.sharded.units import UnitCut, UnitPolicy, cut_model

if TYPE_CHECKING:
    from stratagem.cluster.worker_group import WorkerGroup
    from stratagem.strategies.sharded.host_memory import HostMemory


class RankMemory:
    """What this rank of a ShardedStrategy will hold: the plans of the models distributed (`plans`), the cut of the
    first (`cut`), and the step's activations when given or measured (`activations`)."""

    def __init__(
        self,
        group: WorkerGroup,
        *,
        stage: int,
        device: torch.device,
        policy: UnitPolicy,
        mp: tuple[torch.dtype | None, torch.dtype | None],
        host: HostMemory,
    ) -> None:
        self._group = group
        self._stage = stage
        self._device = device
        self._policy = policy
        self._mp = mp
        self._host = host
        self.cut: UnitCut | None = None  # the first model's (or the one memory_plan(model) planned)
        self.plans: list[MemoryPlan] = []
        self.activations: ActivationEstimate | None = None  # the step's, given or measured (memory_plan)

    def memory_plan(
        self,
        model: nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        example_inputs: Any,
        activations: int | None,
    ) -> MemoryPlan:
        """`ShardedStrategy.memory_plan` (its docstring says what it gives)."""
        part = lambda batch: replica_part(batch, self._group.world_size, self._group.rank)  # noqa: E731
        self.activations = plan_activations(model, example_inputs, activations, part) or self.activations
        if model is None:
            if not self.plans:
                raise InputError(
                    "memory_plan() needs the model until distribute() has run. Received: no model. "
                    "Call strategy.memory_plan(model, optimizer), or distribute first."
                )
            if self.activations is not None:
                how = self.activations.how
                self.plans = [replace(p, activations=self.activations.peak, activations_how=how) for p in self.plans]
            return self.plans[0]
        self.cut = self.cut or cut_model(model, self._policy, stage=self._stage)
        return self.plan(list(model.parameters()), optimizer, self.cut)

    def plan(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer | None, cut: UnitCut) -> MemoryPlan:
        param_dtype, reduce_dtype = self._mp
        shared = self._group.cross_worker.shared  # the units' collectives' file, when connected (transport.py)
        return plan_memory(
            params,
            optimizer,
            rank=self._group.rank,
            world_size=self._group.world_size,
            stage=self._stage,
            largest_unit_bytes=cut.largest_unit_bytes,
            num_units=len(cut.groups),
            compute_element_size=None if param_dtype is None else torch.empty((), dtype=param_dtype).element_size(),
            reduce_element_size=None if reduce_dtype is None else torch.empty((), dtype=reduce_dtype).element_size(),
            transport_bytes=0 if shared is None else (shared.world_size + 1) * shared.capacity,
            allocator=self._host.allocator(),
            root_bytes=cut.root_bytes,
            activations=0 if self.activations is None else self.activations.peak,
            activations_how=None if self.activations is None else self.activations.how,
            received_rows=shared is None and self._group.backend == "gloo" and self._device.type == "cpu",
            batch_check_copy=True,  # the batch check rides every step's first reduce-scatter, on or off
        )

    def check_limit(
        self,
        plan: MemoryPlan,
        params: list[nn.Parameter],
        optimizer: torch.optim.Optimizer | None,
        cut: UnitCut,
        cut_at: Callable[[int], UnitCut] | None = None,
    ) -> None:
        """Refuses a plan over this process's memory limit before anything is sharded (strategies/memory_fit.py);
        `cut_at(stage)`: the model's units at another stage, for the alternatives the refusal names."""
        shared = self._group.cross_worker.shared
        check_plan_fits(
            plan.total,
            read_memory_limit(self._device),
            strategy=f"ShardedStrategy(stage={self._stage}) on {self._group.world_size} workers",
            held=plan.unsharded_model,  # the user's model is built: the limit counts it as used already
            alternatives=lambda: sharded_alternatives(
                params, optimizer, world_size=self._group.world_size, stage=self._stage,
                largest_unit_bytes=cut.largest_unit_bytes, num_units=len(cut.groups),
                transport_per_worker=0 if shared is None else shared.capacity, root_bytes=cut.root_bytes,
                activations=plan.activations, cut_at=cut_at, batch_check_copy=True,
            ),
        )  # fmt: skip
