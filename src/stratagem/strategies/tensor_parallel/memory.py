"""TensorParallelStrategy's memory plan: the bytes one rank holds by category, worked out from the layouts.

A parameter split along `model` is cut as DTensor's `Shard` cuts it (torch.chunk: ceil(n / N) along the split
dimension, the last parts short; `state_memory.chunk_size`); a replicated one is whole on every rank. With L_r
the bytes of rank r's parts (a tied parameter counted once):

- parameters: L_r; gradients: L_r (each gradient is reduced into its parameter's layout as it is accumulated,
  `apply.grads_in_layout`); a gradient DTensor leaves as a pending sum is whole until then: the largest split
  parameter's whole gradient is planned beside the others (`gradient_redistribution`);
- optimizer state and the optimizer step's temporaries: from L_r by the optimizer's class (`state_memory.py`, the
  formulas ShardedStrategy's plan uses);
- the data axis's buffers: on a 2-D mesh each replicated parameter's local gradient is all-reduced in place across
  `data` (Gloo copies it through a buffer of its size: the largest one is planned); 0 on a `model` mesh;
- data sharding (a layout naming `data`, `data_sharding.py`): such a parameter's part is also cut along `data` as
  FSDP2 cuts it (torch.chunk), and so are its gradient and optimizer state; while its unit (the module that owns
  it, the root for a tied one) runs backward, the unit's parameters are whole along `data` again, beside their
  whole gradients, FSDP2's copy of them for the reduce-scatter and the rows Gloo's all-to-all receives: four times
  the largest unit's `model` parts (`data_sharding_buffers`; an upper bound, as the first two overlap only at the
  end of the unit's backward);
- activations: the step's tensors at their peak on this rank, given (`activations=`) or measured by one forward and
  backward of the split model on this group's part of `example_inputs` (`activation_memory.measure_split_step`):
  every redistribution the step makes (partial outputs all-reduced, split logits all-gathered whole, the
  gradients of replicated inputs all-reduced in backward) is a tensor of that step and counted there;
- distribute: the model as the user built it is whole on every rank while its parts are made (plus one whole
  parameter: rank 0's pieces of the one being scattered), freed once the user's optimizer over it is dropped.

The peak of a step: the parameters and optimizer state, and the larger of the activations (backward's start, no
gradient yet after `zero_grad()`) and the gradients with the data axis's buffer and the larger of the optimizer's
temporaries and the gradient redistribution; `total` is the larger of that and distribute's peak, over the
resident set before the model was built. It holds where freed tensors leave the resident set at once
(`allocator`: the strategy maps blocks of 64 KiB and more on their own, as ShardedStrategy does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from stratagem.strategies.state_memory import chunk_size, optimizer_state_bytes, optimizer_temporaries, show_bytes
from stratagem.strategies.tensor_parallel.data_sharding import unit_of
from stratagem.strategies.tensor_parallel.mesh import DeviceMesh, ParameterLayout

NOT_COUNTED = "not counted: pass example_inputs= or activations= to memory_plan"


@dataclass(frozen=True, kw_only=True)
class TensorParallelMemoryPlan:
    """Bytes one rank of a TensorParallelStrategy holds, by category (the module docstring gives the formulas).

    Example:
        >>> plan = strategy.memory_plan(example_inputs={"input_ids": ids, "labels": ids})  # doctest: +SKIP
        >>> plan.parameters + plan.gradients + plan.optimizer_state, plan.total               # doctest: +SKIP
    """

    rank: int
    """The rank this plan is for."""
    mesh: str
    """The mesh's shape and axis names."""
    parameters: int
    """This rank's parts of the parameters: a split parameter's local shard, a replicated one whole."""
    gradients: int
    """This rank's parts of the gradients (the parameters' layouts)."""
    optimizer_state: int | None
    """This rank's optimizer state after its first step (None: an optimizer this plan does not know)."""
    optimizer_temporaries: int = 0
    """What the optimizer's step allocates for a moment (Adam(W)'s denominator of the largest part, twice)."""
    gradient_redistribution: int = 0
    """The largest split parameter's gradient whole, as a pending sum is before it is reduced into its part."""
    data_axis_buffers: int = 0
    """The data axis's all-reduce of the largest local gradient, through a buffer of its size (0: no data axis)."""
    data_sharding_buffers: int = 0
    """The largest unit sharded along `data` in its backward: parameters and gradients whole along `data`, and the
    reduce-scatter's two buffers of that size (0: no layout names `data`)."""
    whole_model: int = 0
    """Bytes of the whole model's parameters: what one device holds."""
    distribute_peak: int = 0
    """The peak while `distribute` splits the model: the whole model as built, its parts, one whole parameter."""
    activations: int = 0
    """The step's tensors on this rank at their peak, the redistributions' included (0: not counted)."""
    activations_how: str = NOT_COUNTED
    """Where `activations` came from: given by the user, measured on the split model, or not counted."""
    allocator: str = ""
    """What the plan assumes of the host allocator (the resident set follows the live tensors, or not)."""

    @property
    def training_peak(self) -> int | None:
        """The parameters and optimizer state, and the larger of the activations (backward's start, before any
        gradient) and the gradients beside the data axis's buffer and the larger of the optimizer's temporaries and
        the gradient redistribution; None when the optimizer state is unknown."""
        if self.optimizer_state is None:
            return None
        at_rest = self.parameters + self.optimizer_state
        transient = max(self.optimizer_temporaries, self.gradient_redistribution, self.data_sharding_buffers)
        return at_rest + max(self.activations, self.gradients + self.data_axis_buffers + transient)

    @property
    def total(self) -> int | None:
        """The peak resident set this rank reaches over its resident set before the model was built, in bytes: the
        larger of `distribute_peak` and `training_peak` (None when the optimizer state is unknown)."""
        training = self.training_peak
        return None if training is None else max(training, self.distribute_peak)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"training_peak": self.training_peak, "total": self.total}

    def __str__(self) -> str:
        state = "unknown optimizer" if self.optimizer_state is None else show_bytes(self.optimizer_state)
        return (
            f"rank {self.rank}, mesh {self.mesh}: parameters {show_bytes(self.parameters)}, gradients "
            f"{show_bytes(self.gradients)}, optimizer state {state}"
            + (
                f", optimizer temporaries {show_bytes(self.optimizer_temporaries)}"
                if self.optimizer_temporaries
                else ""
            )
            + (f", gradient redistribution {show_bytes(self.gradient_redistribution)}")
            + (f", data-axis buffer {show_bytes(self.data_axis_buffers)}" if self.data_axis_buffers else "")
            + (f", data sharding {show_bytes(self.data_sharding_buffers)}" if self.data_sharding_buffers else "")
            + (
                f", activations {show_bytes(self.activations)} ({self.activations_how})"
                if self.activations
                else f", activations {self.activations_how}"
            )
            + f" (whole model {show_bytes(self.whole_model)})"
            + (f"; peak {show_bytes(self.total)}" if self.total is not None else "")
            + f" (in distribute {show_bytes(self.distribute_peak)})"
            + (f"; allocator: {self.allocator}" if self.allocator else "")
        )


def local_bytes(
    layout: ParameterLayout, element_size: int, mesh: DeviceMesh, model_index: int, data_index: int | None = 0
) -> int:
    """Bytes of this rank's part of a parameter of `layout`: each dimension split along `model` (or `data`) cut as
    DTensor's `Shard` and FSDP2 cut it, at this rank's index along that axis; whole where it is replicated.
    `data_index=None`: the `model` part alone, whole along `data` (as a unit holds it while it runs)."""
    index = {"model": model_index, "data": data_index}
    numel = 1
    for size, axis in zip(layout.shape, layout.layout):
        at = index.get(axis) if axis is not None else None
        numel *= size if axis is None or at is None else chunk_size(size, mesh.axis_size(axis), at)
    return numel * element_size


def plan_tensor_parallel_memory(
    layouts: Sequence[ParameterLayout],
    parameters: Mapping[str, nn.Parameter],
    optimizer: torch.optim.Optimizer | None,
    *,
    mesh: DeviceMesh,
    rank: int,
    activations: int = 0,
    activations_how: str | None = None,
    allocator: str = "",
) -> TensorParallelMemoryPlan:
    """The plan of rank `rank` for the parameters as the user built them (`parameters`: by every name of
    `named_parameters(remove_duplicate=False)`, so a layout's first name finds its tensor) and the user's
    `optimizer` over them; `activations`: the step's on this rank at their peak, `activations_how` whence."""
    model_index = rank % mesh.axis_size("model")  # ranks are row-major: `model` varies fastest
    data_index = rank // mesh.axis_size("model")
    mine: dict[int, int] = {}
    trainable: list[int] = []
    summed: list[int] = []  # the trainable parts the data axis all-reduces (not sharded along it)
    units: dict[str, int] = {}  # each unit sharded along `data`: its `model` parts, whole along `data`
    whole = largest_whole = largest_split = 0
    for layout in layouts:
        param = parameters[layout.names[0]]
        part = local_bytes(layout, param.element_size(), mesh, model_index, data_index)
        mine[id(param)] = part
        if param.requires_grad:
            trainable.append(part)
        if "data" in layout.layout:
            unit = unit_of(layout)
            units[unit] = units.get(unit, 0) + local_bytes(layout, param.element_size(), mesh, model_index, None)
        elif param.requires_grad:
            summed.append(part)
        size = param.numel() * param.element_size()
        whole += size
        largest_whole = max(largest_whole, size)
        if "model" in layout.layout and param.requires_grad:
            largest_split = max(largest_split, size)
    local = sum(mine.values())
    return TensorParallelMemoryPlan(
        rank=rank,
        mesh=f"{mesh.shape} {mesh.axis_names}",
        parameters=local,
        gradients=sum(trainable),
        optimizer_state=optimizer_state_bytes(optimizer, mine),
        optimizer_temporaries=optimizer_temporaries(optimizer, mine),
        gradient_redistribution=largest_split,
        data_axis_buffers=max(summed, default=0) if "data" in mesh.axis_names else 0,
        data_sharding_buffers=4 * max(units.values(), default=0),
        whole_model=whole,
        distribute_peak=whole + local + largest_whole,
        activations=activations,
        activations_how=activations_how or NOT_COUNTED,
        allocator=allocator,
    )
