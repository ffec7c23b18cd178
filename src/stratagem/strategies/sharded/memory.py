"""The memory plan: bytes per rank by category, worked out before the first step.

FSDP2 cuts every parameter along its first dimension into `world_size` chunks of ceil(rows / N) rows;
rank r holds rows [r * chunk, min((r + 1) * chunk, rows)) (possibly none). With P_r the bytes of those
rows on rank r:

- parameters at rest: P_r (stage 2 and 3 alike: between steps only the shards exist);
- gradients: P_r (each reduce-scatter leaves this rank only its shard's sum);
- optimizer state: k * P_r plus the per-parameter step counters, k = the state tensors the optimizer
  keeps per parameter (SGD with momentum 1, Adagrad 1, Adam and AdamW 2, 3 with amsgrad, ...;
  `state_memory.py`, shared with every plan);
- gathered working set at the peak: stage 3 gathers one unit at a time and prefetches the next, and
  backward holds the unit's unsharded gradients while FSDP2 copies them into the flat input of its
  reduce-scatter (the gradients are freed only after that copy): 2 U + U_grad + U_rs, U the largest unit
  in the compute dtype, U_rs the same unit in the reduce dtype (U + U_grad + U_rs when the whole model
  is one unit); stage 2 keeps every unit gathered from forward to backward: the whole model M plus
  U_grad + U_rs; through Gloo two more U_rs: the flat input and the rows received of the unit whose
  all-to-all is still under way while the next unit's gradients are made (`reduce_scatter._Deferred`), the
  rows each rank receives in the all-to-all its reduce-scatter is built from; and under the strategy one more U_rs,
  the wider buffer the step's first reduce-scatter copies its unit's gradients into to carry the workers'
  batch check (`reduce_scatter.WeightedReduceScatter._ride`);
- transport: the shared-memory file the units' collectives go through on one host (`transport.py`), which
  every rank maps and reads whole: (N + 1) slots of its chunk size; 0 through the process group.
- activations: what the step's own tensors take at their peak on this rank (given, or measured by one
  forward and backward on fake tensors: `activation_memory.py`), 0 when neither; they peak as backward
  starts, beside the parameters gathered then: the root's own at stage 3 (FSDP2 keeps the root gathered
  from forward to backward), the whole model at stage 2. The units gathered later in backward meet
  activations already partly freed, so the plan takes the larger of the two peaks, not their sum.

Against plain data parallelism (a whole copy of parameters, gradients and state per rank: (2 + k) M
with fp32 AdamW's k = 2 giving DeepSpeed's 16 bytes per parameter), the state at rest falls by N.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from stratagem.strategies.state_memory import chunk_size, optimizer_state_bytes, optimizer_temporaries, show_bytes


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Bytes one rank holds, by category (see the module docstring for the formulas).

    Example:
        >>> plan = strategy.memory_plan(model, optimizer)                        # doctest: +SKIP
        >>> plan.parameters + plan.gradients + plan.optimizer_state              # doctest: +SKIP
    """

    rank: int
    """The rank this plan is for."""
    world_size: int
    stage: int
    parameters: int
    """This rank's shards of the parameters, at rest."""
    gradients: int
    """This rank's shards of the gradients after a step's reduce-scatter."""
    optimizer_state: int | None
    """This rank's shards of the optimizer's state after its first step (None: an optimizer this plan does not know)."""
    gathered_peak: int
    """Unsharded parameters and gradients held at once at the peak of forward and backward."""
    unsharded_model: int
    """Bytes of the whole model's parameters: what every rank would hold without sharding."""
    replicated: int | None = None
    """What a rank of plain data parallelism holds: the whole parameters, gradients and optimizer state."""
    transport: int = 0
    """The shared-memory file this rank maps for the units' all-gathers and reduce-scatters (0: the process group)."""
    optimizer_temporaries: int = 0
    """What the optimizer's step allocates for a moment: torch's per-parameter Adam(W) and RMSprop build a
    denominator of this rank's largest shard (two tensors of it at once); 0 for SGD."""
    distribute_peak: int = 0
    """The peak while `distribute` shards the model in place: the whole model as the user built it, and the
    shards (padded to FSDP2's equal chunks) made from it before its whole tensors are freed."""
    allocator: str = ""
    """What the plan assumes of the host allocator (the resident set follows the live tensors, or not)."""
    activations: int = 0
    """The step's activations on this rank at their peak (0: not counted; see `activations_how`)."""
    activations_how: str = "not counted: pass example_inputs= or activations= to memory_plan"
    """Where `activations` came from: given by the user, measured on fake tensors, or not counted."""
    gathered_with_activations: int = 0
    """The parameters gathered when the activations peak (backward's start): the root's own at stage 3, the
    whole model at stage 2."""

    @property
    def training_peak(self) -> int | None:
        """The peak of a training step: the parameter and optimizer state shards, the transport, and the larger of
        the gradient shards beside the gathered working set (stage 3) or the gathered working set alone (stage 2),
        and the gradient shards beside the optimizer's temporaries; or, when larger, the state at rest beside the
        activations and the parameters gathered with them; None when the optimizer state is unknown."""
        if self.optimizer_state is None:
            return None
        at_rest = self.parameters + self.optimizer_state + self.transport
        # Backward's start: every activation alive, no gradient shard yet (zero_grad freed the last step's).
        activations = at_rest + self.gathered_with_activations + self.activations if self.activations else 0
        if self.stage == 3:  # the last unit's backward: every gradient shard but its own, and the working set
            return max(activations, at_rest + self.gradients + max(self.gathered_peak, self.optimizer_temporaries))
        # Stage 2: the whole model is gathered when backward starts, before any gradient shard exists; the
        # gathered units are freed as their gradient shards arrive, and the optimizer step comes after both.
        return max(activations, at_rest + max(self.gathered_peak, self.gradients + self.optimizer_temporaries))

    @property
    def total(self) -> int | None:
        """The peak resident set this rank reaches over its resident set before the model was built, in bytes:
        the larger of `distribute_peak` and `training_peak`; None when the optimizer state is unknown. Holds under
        the allocator that `allocator` names, with the activations that `activations_how` names."""
        training = self.training_peak
        return None if training is None else max(training, self.distribute_peak)

    def against_replica(self) -> str | None:
        """Why memory dropped by what it did against a whole copy per rank (None: not known)."""
        total = self.total
        if total is None or not self.replicated:
            return None
        at_rest = self.parameters + self.gradients + (self.optimizer_state or 0)
        return (
            f"{show_bytes(total)} per rank against a whole copy's {show_bytes(self.replicated)} "
            f"({total / self.replicated:.2f}x): the state at rest ({show_bytes(at_rest)}) is sharded "
            f"{self.world_size} ways, "
            f"but the gathered working set ({show_bytes(self.gathered_peak)}: "
            + ("the largest unit twice, its gradients and their reduce-scatter input" if self.stage == 3
               else "the whole model, and the largest unit's gradients and their reduce-scatter input")
            + ") is not divided by N; smaller units (units=...) lower it"
            + (", and stage 3 frees each unit after its forward" if self.stage == 2 else "")
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"total": self.total}

    def __str__(self) -> str:
        state = "unknown optimizer" if self.optimizer_state is None else show_bytes(self.optimizer_state)
        return (
            f"rank {self.rank}/{self.world_size}, stage {self.stage}: parameters {show_bytes(self.parameters)}, "
            f"gradients {show_bytes(self.gradients)}, optimizer state {state}, gathered at peak {show_bytes(self.gathered_peak)} "
            f"(unsharded model {show_bytes(self.unsharded_model)})"
            + (f", shared-memory transport {show_bytes(self.transport)}" if self.transport else "")
            + (
                f", optimizer temporaries {show_bytes(self.optimizer_temporaries)}"
                if self.optimizer_temporaries
                else ""
            )
            + (
                f", activations {show_bytes(self.activations)} ({self.activations_how})"
                if self.activations
                else f", activations {self.activations_how}"
            )
            + (f"; peak {show_bytes(self.total)}" if self.total is not None else "")
            + (f" (in distribute {show_bytes(self.distribute_peak)})" if self.distribute_peak else "")
            + (f"; allocator: {self.allocator}" if self.allocator else "")
        )


def shard_rows(rows: int, world_size: int, rank: int) -> int:
    """Rows of a first dimension of `rows` that FSDP2 gives `rank` (ceil-sized chunks, the last ones short)."""
    return chunk_size(rows, world_size, rank)


def shard_bytes(shape: torch.Size, element_size: int, world_size: int, rank: int) -> int:
    """Bytes of `rank`'s shard of a tensor of `shape` (a 0-dim tensor counts as one row)."""
    if len(shape) == 0:
        return element_size if rank == 0 else 0
    per_row = math.prod(shape[1:]) * element_size
    return shard_rows(shape[0], world_size, rank) * per_row


def plan_memory(
    params: Iterable[nn.Parameter],
    optimizer: torch.optim.Optimizer | None,
    *,
    rank: int,
    world_size: int,
    stage: int,
    largest_unit_bytes: int,
    num_units: int = 1,
    compute_element_size: int | None = None,
    reduce_element_size: int | None = None,
    transport_bytes: int = 0,
    allocator: str = "",
    root_bytes: int = 0,
    activations: int = 0,
    activations_how: str | None = None,
    received_rows: bool = False,
    batch_check_copy: bool = False,
) -> MemoryPlan:
    """The plan for the model's ORIGINAL (unsharded) parameters `params` and the user's `optimizer`.

    `largest_unit_bytes`: the largest unit's parameters in their own dtype; `num_units`: the units besides the
    root (0: the whole model is one unit, nothing is prefetched); `compute_element_size` and
    `reduce_element_size`: the bytes of one element of the mixed-precision parameter and reduce dtypes,
    when set; `transport_bytes`: the shared-memory file the units' collectives go through, when they do;
    `root_bytes`: the root's own parameters (those no unit holds); `activations`: the step's activations on this
    rank at their peak, `activations_how` where that figure came from; `received_rows`: the reduce-scatter is an
    all-to-all through Gloo, which receives one more flat gradient buffer while a unit's input and rows stay in
    flight beside the next unit's (two more in all); `batch_check_copy`: the step's first
    reduce-scatter copies its unit's flat gradients into a wider buffer that carries the batch check.
    """
    params = list(params)
    mine = {id(p): shard_bytes(p.shape, p.element_size(), world_size, rank) for p in params}
    local = sum(mine.values())
    whole = sum(p.numel() * p.element_size() for p in params)
    scale = 1.0
    if compute_element_size is not None and params:
        scale = compute_element_size / params[0].element_size()
    unit = int(largest_unit_bytes * scale)
    reduce_input = unit
    if reduce_element_size is not None and params:
        reduce_input = int(largest_unit_bytes * reduce_element_size / params[0].element_size())
    # With no unit below the root there is nothing to prefetch: the model and its unsharded gradients.
    held = (2 * unit if num_units else unit) if stage == 3 else int(whole * scale)
    # Through Gloo, the rows received; with units below the root, also the input and rows of the unit whose
    # all-to-all is under way beside the next unit's (reduce_scatter._Deferred).
    in_flight = received_rows * (2 if num_units else 1)
    gathered = held + unit + reduce_input * (1 + in_flight + batch_check_copy)
    # FSDP2 pads every shard to the first rank's chunk (ceil(rows / N) rows).
    padded = sum(shard_bytes(p.shape, p.element_size(), world_size, 0) for p in params)
    return MemoryPlan(
        rank=rank,
        world_size=world_size,
        stage=stage,
        parameters=local,
        gradients=local,
        optimizer_state=optimizer_state_bytes(optimizer, mine),
        gathered_peak=gathered,
        unsharded_model=whole,
        replicated=_replicated_bytes(params, optimizer, whole),
        transport=transport_bytes,
        optimizer_temporaries=optimizer_temporaries(optimizer, mine),
        distribute_peak=whole + padded,
        allocator=allocator,
        activations=activations,
        gathered_with_activations=int((root_bytes if stage == 3 and num_units else whole) * scale),
        **({"activations_how": activations_how} if activations_how else {}),
    )


def release_freed_memory() -> None:
    """After `distribute`: the heap's free pages (the whole tensors of a model built before the strategy set
    its allocator, freed as their shards replaced them) go back to the system."""
    from stratagem.cluster.allocator import trim_here

    trim_here()


def _replicated_bytes(params: list[nn.Parameter], optimizer: torch.optim.Optimizer | None, whole: int) -> int | None:
    state = optimizer_state_bytes(optimizer, {id(p): p.numel() * p.element_size() for p in params})
    return None if state is None else 2 * whole + state
