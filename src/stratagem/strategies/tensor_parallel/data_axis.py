"""`apply_replication`: the `data` axis of a 2-D mesh for every parameter replicated along it: each model group's
gradients summed across the data groups, weighted (the parameters whose layout names `data` are sharded along it
instead, their gradients reduce-scattered: `data_sharding.py`).

Every worker of one model group trains on the same slice of the global batch; the data groups' slices differ in
size by at most one. Inside `backward()` (an autograd callback queued by the first gradient, as the data-parallel
strategies do, so clipping sees the combined gradient) each worker scales its local part of every gradient by its
group's share of the global batch and all-reduces it (SUM) with the workers that hold the same part in the other
data groups: the result is one device's gradient on the whole batch, whatever the split.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn

from stratagem.errors import InputError


class DataAxisSum:
    """Weighted SUM of every gradient's local part across the `data` process group, at the end of each backward."""

    def __init__(self, params: Sequence[nn.Parameter], group: Any, weight: Callable[[], float]) -> None:
        self._params = [p for p in params if p.requires_grad]
        self._group = group
        self._weight = weight
        self._queued = False
        # The gradient tensors summed already, by identity: one met again was accumulated into. Keyed by id with a weak
        # reference to check it is the same tensor (an id is reused once freed); not a WeakSet, whose membership test
        # compares tensors with ==, elementwise, and raises for a gradient of more than one element.
        self._summed: dict[int, weakref.ref[torch.Tensor]] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._sum)

    def _sum(self) -> None:
        import torch.distributed as dist

        self._queued = False
        weight = self._weight()
        with torch.no_grad():
            for param in self._params:
                grad = param.grad
                if grad is None:
                    continue
                summed = self._summed.get(id(grad))
                if summed is not None and summed() is grad:
                    raise InputError(
                        "A gradient the data axis had summed was accumulated into again, on a 2-D mesh, so it would be "
                        "summed twice. Received: a second backward before zero_grad(), or zero_grad(set_to_none=False), "
                        "which keeps the summed tensor. Call optimizer.zero_grad() (set_to_none=True, its default) "
                        "between steps; accumulation on the data axis is not supported yet."
                    )
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                local.mul_(weight)
                dist.all_reduce(local, group=self._group)
                self._summed = {k: r for k, r in self._summed.items() if r() is not None}
                self._summed[id(grad)] = weakref.ref(grad)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def apply_replication(
    model: nn.Module, mesh: Any, skip: Collection[str], weight: Callable[[], float]
) -> DataAxisSum | None:
    """Every parameter of `model` whose names are not in `skip` (those `data_sharding.apply_data_sharding` took)
    summed across the `data` axis of `mesh` (torch's DeviceMesh) at the end of each backward, weighted by `weight()`;
    None on a mesh with no `data` axis."""
    if "data" not in (mesh.mesh_dim_names or ()):
        return None
    params = [p for name, p in model.named_parameters() if name not in skip]
    return DataAxisSum(params, mesh["data"].get_group(), weight)
