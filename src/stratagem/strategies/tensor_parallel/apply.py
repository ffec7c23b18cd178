"""`apply_tensor_parallel`: each parameter made a DTensor by its layout, and the forward run over DTensors.

Keras 3 on JAX places each variable by its layout and lets the compiler propagate shardings through the graph;
here torch's DTensor does the propagation, op by op: a split `Linear` computes its part, and where the next op
needs another placement (a sum of partial products, a whole tensor) DTensor inserts the collective. Tensors the
model makes itself (position ids, masks) are plain; `implicit_replication` treats them as replicated. The
outputs are handed back as plain whole tensors, so the loss, `strategy.reduce` and the user's metrics see what
one device gives.

Every redistribution is deterministic and every worker of the `model` axis ends it with the same bits, so the
replicated parameters stay identical across workers with no extra all-reduce. A gradient DTensor's propagation
leaves as a pending sum (`Partial`: the whole tensor on every worker, as for a layer between two split ones) is
reduced into its parameter's placement as it is accumulated (`grads_in_layout`), so every gradient is its
parameter's part, `clip_grad_norm_` sums the squares over every shard (the global norm), and the optimizer step
redistributes nothing (it otherwise reduce-scattered such a gradient again in each of its operations).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from stratagem import nest
from stratagem.strategies.tensor_parallel.mesh import Layout, ParameterLayout
from stratagem.strategies.wrapped_model import WrappedModel


def placements(layout: Layout, axis_names: Sequence[str]) -> list[Any]:
    """DTensor placements over the mesh `axis_names` for `layout`: Shard(dim) on the axis that splits dim."""
    from torch.distributed.tensor import Replicate, Shard

    out: list[Any] = [Replicate() for _ in axis_names]
    for dim, axis in enumerate(layout):
        if axis is not None:
            out[axis_names.index(axis)] = Shard(dim)
    return out


def apply_tensor_parallel(model: nn.Module, layouts: Sequence[ParameterLayout], mesh: Any) -> dict[int, nn.Parameter]:
    """Replaces every parameter of `model` in place by a DTensor parameter over `mesh` (torch's DeviceMesh: the
    `model` axis, or the whole mesh), split along `model` as its layout says and replicated along `data` where the
    mesh has it (sharding along `data` is `data_sharding.py`'s, after this); tied parameters stay one. Returns the
    id of each old parameter to its new one.

    Every worker receives rank 0's values (`distribute_tensor` scatters from it), as one device would hold them.
    """
    from torch.distributed.tensor import distribute_tensor

    by_name = {name: layout for layout in layouts for name in layout.names}
    made: dict[int, nn.Parameter] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in made:
                layout = tuple(
                    a if a != "data" else None for a in by_name[f"{prefix}.{name}" if prefix else name].layout
                )
                value = distribute_tensor(param.detach(), mesh, placements(layout, mesh.mesh_dim_names))
                made[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
            setattr(module, name, made[id(param)])  # nn.Module registers it; a tied parameter gets the same one
    return made


def grads_in_layout(params: Sequence[nn.Parameter]) -> list[Any]:
    """A hook on each DTensor parameter that redistributes its gradient, once accumulated, to the parameter's own
    placements (a reduce-scatter or all-reduce of a pending sum; nothing where they agree); the hooks' handles."""
    from torch.distributed.tensor import DTensor

    def to_layout(param: torch.Tensor) -> None:
        grad = param.grad
        if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)

    return [p.register_post_accumulate_grad_hook(to_layout) for p in params if isinstance(p, DTensor)]


class TensorParallelModel(WrappedModel):
    """The user's model (`.module`), called with plain inputs taken as replicated and DTensor outputs made whole."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with replicated_plain_tensors():
            output = self.module(*args, **kwargs)
        return nest.map_structure(whole, output)


_depth = threading.local()


@contextlib.contextmanager
def replicated_plain_tensors() -> Iterator[None]:
    """DTensor's `implicit_replication`, re-entrant: torch's switches the flag off on leaving even when an outer
    block (the step around the model's forward) had it on."""
    from torch.distributed.tensor.experimental import implicit_replication

    depth = getattr(_depth, "value", 0)
    _depth.value = depth + 1
    try:
        if depth:
            yield
        else:
            with implicit_replication():
                yield
    finally:
        _depth.value = depth


def whole(value: Any) -> Any:
    """A DTensor as the plain tensor one device would hold (differentiable); anything else unchanged."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(value, DTensor):
        return value
    if all(isinstance(p, Replicate) for p in value.placements):
        return value.to_local()
    return value.full_tensor()


def whole_tensor(value: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (`full_tensor()` of a DTensor, the tensor itself otherwise), for checks and reports."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value
