"""Hooks the strategy puts on the split model so that any step function trains it, `sg.fit`'s included.

- `replicate_conv_inputs`: a convolution's plain input made a replicated DTensor before its forward (torch's
  DTensor convolution takes no plain tensor in backward);
- `BackwardInsideRun`: a backward of the split model run outside `strategy.run` refused, naming the fix, before
  torch stops in the middle of it;
- `refuse_dropout_on_partial_sums`: a dropout handed a pending sum refused, naming the module and the fix, before
  DTensor fails inside it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stratagem import nest
from stratagem.errors import InputError


def replicate_conv_inputs(model: nn.Module, mesh: Any) -> list[Any]:
    """A forward pre-hook on each convolution of `model` that hands it a plain input as a replicated DTensor; the
    hooks' handles. DTensor's convolution backward (torch's `_tp_conv`) takes only DTensor inputs, with no implicit
    replication: a model's first convolution, whose input is the user's plain batch, failed in backward with a bare
    AssertionError (as torch's own `distribute_module(input_fn=...)` does, the input is made a DTensor first)."""
    from torch.distributed.tensor import DTensor, Replicate

    def to_replicated(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        replicate = [Replicate()] * mesh.ndim
        return tuple(
            DTensor.from_local(a, mesh, replicate, run_check=False)
            if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
            else a
            for a in args
        )

    convolutions = [m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)]
    return [m.register_forward_pre_hook(to_replicated) for m in convolutions]


def refuse_dropout_on_partial_sums(model: nn.Module) -> list[Any]:
    """A forward pre-hook on each dropout of `model` (p > 0) that refuses an input holding a pending sum (a DTensor
    with a `Partial` placement: the output of a layer split along its input features, GPT-2's `c_proj`, before its
    all-reduce); the hooks' handles. DTensor cannot draw a dropout mask on a partial sum (`aten.bernoulli_` fails
    its sharding propagation with a message that names neither the module nor the layout), so the refusal comes
    first, at the first forward, before any parameter changes."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Partial

    def check(name: str) -> Any:
        def refuse_partial(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not module.training:
                return
            for arg in args:
                if isinstance(arg, DTensor) and any(isinstance(p, Partial) for p in arg.placements):
                    raise InputError(
                        f"The dropout {name!r} (p={getattr(module, 'p', '?')}) is handed a pending sum: the output "
                        "of a layer split along its input features, before the all-reduce that makes it whole, "
                        "where no dropout mask can be drawn. Received: an input with placements "
                        f"{tuple(arg.placements)}. Build the model with that dropout's p = 0 (GPT-2: resid_pdrop=0), "
                        "or lay the layer before it out along its output features."
                    )

        return refuse_partial

    dropouts = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.dropout._DropoutNd) and getattr(m, "p", 0) > 0
    ]
    return [m.register_forward_pre_hook(check(name)) for name, m in dropouts]


class BackwardInsideRun:
    """Refuses, at the first gradient that reaches the split model, a backward run outside `strategy.run`.

    The forward runs under DTensor's implicit replication wherever it is called (`apply.TensorParallelModel`), but
    its backward replays ops whose saved plain tensors (the ids of an embedding, the labels of a loss) meet DTensor
    gradients, and autograd runs them with the switches in force where `backward()` was called: outside `run`,
    torch stops in the middle of the backward with "got mixed torch.Tensor and DTensor". A hook on each DTensor
    output of the forward sees the switch before any gradient is accumulated, and says what to do instead.
    """

    def __init__(self, module: nn.Module) -> None:
        self._handle = module.register_forward_hook(self._on_output)

    def _on_output(self, module: nn.Module, args: Any, output: Any) -> None:
        from torch.distributed.tensor import DTensor

        for leaf in nest.flatten(output):
            if isinstance(leaf, DTensor) and leaf.requires_grad:
                leaf.register_hook(self._on_grad)

    @staticmethod
    def _on_grad(grad: torch.Tensor) -> None:
        from torch.distributed.tensor import DTensor

        if not DTensor._op_dispatcher._allow_implicit_replication:
            raise InputError(
                "TensorParallelStrategy runs a step's backward inside strategy.run, where the plain tensors the "
                "forward saved (the ids of an embedding, the labels of a loss) count as replicated across the mesh. "
                "Received: backward() of the split model's output outside strategy.run. Call loss.backward() (and "
                "the optimizer's step) inside the step function given to strategy.run, as docs/tensor_parallel.md "
                "shows, or train with sg.fit, whose step does."
            )

    def remove(self) -> None:
        self._handle.remove()
