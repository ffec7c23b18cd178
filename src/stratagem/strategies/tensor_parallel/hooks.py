"""Hooks the strategy puts on the split model so that any step function trains it, `sg.fit`'s included.

- `replicate_conv_inputs`: a convolution's plain input made a replicated DTensor before its forward (torch's
  DTensor convolution takes no plain tensor in backward);
- `BackwardInsideRun`: a backward of the split model run outside `strategy.run` refused, naming the fix, before
  torch stops in the middle of it.
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
