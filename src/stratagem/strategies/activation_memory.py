"""The activation memory of one training step, measured on fake tensors before anything is trained.

A memory plan counts the tensors a strategy keeps (parameters, gradients, optimizer state, gathered units);
the step's activations depend on the model and the batch, and on a transformer they are most of the peak
(issue 39: a tiny GPT-2 at 8 x 128 tokens per rank peaks 578 MiB over its state, the plan was 302 MiB).
`measure_activations` runs the model's forward and a backward from its loss once, under torch's
`FakeTensorMode` (every tensor has a shape, a dtype and a device, and no data: no memory, no arithmetic), and a
dispatch mode that adds each new storage's bytes when an operator makes it and takes them off when the storage
dies. The peak of that sum is what the step's tensors take at once besides the parameters, as on one device.

Parameter gradients are dropped as soon as they are accumulated (a strategy's plan counts them on its own, as
its gathered working set); views of the parameters and the inputs make no new storage and count nothing.
The user's module, its buffers and the CPU generator are left as they were: the forward runs through
`torch.func.functional_call` on fake copies of the parameters and buffers, and random operators on fake tensors
draw nothing.

A model whose parameters are DTensors already (TensorParallelStrategy's, after `distribute`) cannot run on fake
tensors: DTensor's uneven splits read shard offsets from tensors. `measure_split_step` runs its forward and
backward once on real tensors instead (every worker of the mesh together, as a step runs), with the same count:
each storage an operator returns, or a DTensor's local part, or one first met as an operator's input (the whole
logits a redistribution all-gathers outside any operator), counted until it dies.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from stratagem.errors import InputError


@dataclass(frozen=True, kw_only=True)
class ActivationEstimate:
    """The bytes a step's activations take on one rank, and how that figure was found.

    Example:
        >>> estimate = measure_activations(model, (x,))                      # doctest: +SKIP
        >>> estimate.peak, estimate.how                                       # doctest: +SKIP
    """

    peak: int
    """Bytes of the step's tensors alive at once at their peak (usually as backward starts)."""
    after_forward: int
    """Bytes alive when the forward returned: what backward saved, the output and the loss."""
    how: str
    """Where the figure came from, for the plan's text."""


class _LiveStorages(TorchDispatchMode):
    """Adds each new storage an operator returns and subtracts it when the storage is freed."""

    def __init__(self, known: list[torch.Tensor], *, inputs_too: bool = False) -> None:
        super().__init__()
        self._inputs_too = inputs_too  # count a storage first met as an operator's input (made outside any operator)
        self.live = 0
        self.peak = 0
        # Storages made before the step (parameters, buffers, inputs) count nothing, nor do their views.
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for t in known:
            self._seen[t.untyped_storage()] = 0
        self._refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self._inputs_too:  # made outside any operator (a redistribution's result): seen as an input here
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    self._add(_storage(t))
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(_storage(t))
        return out

    def _add(self, storage: torch.UntypedStorage) -> None:
        if storage in self._seen:  # an in-place result or a view: the storage is counted already
            return
        nbytes = storage.nbytes()
        self._seen[storage] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self._refs.append(weakref.ref(storage, functools.partial(self._free, nbytes)))

    def _free(self, nbytes: int, _ref: object) -> None:
        self.live -= nbytes


def measure_activations(model: nn.Module, inputs: Any) -> ActivationEstimate:
    """The activation bytes of `model`'s forward on `inputs` and a backward from its loss, on fake tensors.

    `inputs`: the arguments of one replica's forward: a tensor, a tuple or list of positional arguments, or a
    dict of keyword arguments (`{"input_ids": ids, "labels": ids}`). The loss is the output's `loss` (a Hugging
    Face output, or a dict with one), else the output itself summed (a loss outside the model, such as a mean
    squared error, adds tensors of the output's size, which this leaves out).

    Example:
        >>> measure_activations(nn.Linear(4, 2), torch.randn(8, 4)).peak              # doctest: +SKIP
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, kwargs = _as_call(inputs)
    rng = torch.random.get_rng_state()
    fake = FakeTensorMode(allow_non_fake_inputs=True)  # a constant tensor kept on the module is read as it is
    try:
        with fake:
            params = {n: fake.from_tensor(p).requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
            buffers = {n: fake.from_tensor(b) for n, b in model.named_buffers()}
            args, kwargs = tree_map_only(torch.Tensor, fake.from_tensor, (args, kwargs))
            # The strategy plans the parameter gradients itself: drop each one once it is accumulated.
            for p in params.values():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(_drop_grad)
            known = [*params.values(), *buffers.values(), *tree_leaves((args, kwargs))]
            tracker = _LiveStorages([t for t in known if isinstance(t, torch.Tensor)])
            with tracker:
                output = torch.func.functional_call(model, {**params, **buffers}, tuple(args), kwargs)
                loss = _loss_of(output)
                after_forward = tracker.live
                loss.backward()
                del output, loss
    except (RuntimeError, NotImplementedError) as error:
        raise InputError(
            "The step's activations could not be measured on fake tensors: the forward reads a value or calls "
            f"an operator torch cannot run without data. Received: {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}. Give the bytes instead: "
            "memory_plan(activations=...)."
        ) from error
    finally:
        torch.random.set_rng_state(rng)
    return ActivationEstimate(
        peak=tracker.peak,
        after_forward=after_forward,
        how=(
            "measured: one forward and backward of this rank's part of the example inputs on fake tensors "
            "(torch FakeTensorMode), each parameter gradient only until it is accumulated"
        ),
    )


def plan_activations(
    model: nn.Module | None, example_inputs: Any, activations: int | None, part: Callable[[Any], Any]
) -> ActivationEstimate | None:
    """What `memory_plan(model, example_inputs=..., activations=...)` was told of the step's activations: measured
    on `part(example_inputs)` (this rank's part of the global batch), given, or None when neither was passed."""
    from torch.distributed.tensor import DTensor

    if example_inputs is not None and activations is not None:
        raise InputError(
            "memory_plan takes example_inputs (measured) or activations (given), not both. "
            f"Received: example_inputs of type {type(example_inputs).__name__} and activations={activations}."
        )
    if example_inputs is not None:
        if model is None or any(isinstance(p, DTensor) for p in model.parameters()):
            raise InputError(
                "example_inputs are measured on the model before it is sharded. Received: "
                + ("no model" if model is None else "a model already sharded (by distribute or scope())")
                + ". Call strategy.memory_plan(model, optimizer, example_inputs=...) before distribute, or "
                "give this rank's bytes: memory_plan(activations=...)."
            )
        return measure_activations(model, part(example_inputs))
    if activations is None:
        return None
    if isinstance(activations, bool) or not isinstance(activations, int) or activations < 0:
        raise InputError(f"activations must be this rank's bytes, an int >= 0. Received: activations={activations!r}.")
    return ActivationEstimate(peak=activations, after_forward=activations, how="given")


def measure_split_step(model: nn.Module, inputs: Any, around: Callable[[], Any]) -> ActivationEstimate:
    """The activation bytes of one forward of `model` (its parameters DTensors already) on `inputs` and a backward
    from its loss, run for real under the context `around()` makes; every worker of the mesh calls it together.

    Parameter gradients are dropped as soon as they are accumulated, so nothing of the training state changes;
    the random state is restored. `inputs` as in `measure_activations`.
    """
    from torch.distributed.tensor import DTensor

    args, kwargs = _as_call(inputs)
    params = list(model.parameters())
    known = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    known += [b for b in model.buffers()] + [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    rng = torch.random.get_rng_state()
    try:
        with _grads_dropped(params), around():
            tracker = _LiveStorages([t.detach() for t in known], inputs_too=True)
            with tracker:
                loss = _loss_of(model(*args, **kwargs))
                after_forward = tracker.live
                loss.backward()
                del loss
    finally:
        torch.random.set_rng_state(rng)
    return ActivationEstimate(
        peak=tracker.peak,
        after_forward=after_forward,
        how=(
            "measured: one forward and backward of this rank's part of the example inputs on the split model "
            "(every worker together), each parameter gradient only until it is accumulated"
        ),
    )


@contextlib.contextmanager
def _grads_dropped(params: Sequence[torch.Tensor]) -> Iterator[None]:
    handles = [p.register_post_accumulate_grad_hook(_drop_grad) for p in params if p.requires_grad]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage that holds `t`'s data: a DTensor's local part's."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local().untyped_storage()
    return t.untyped_storage()


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


def _as_call(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    raise InputError(
        "example_inputs must be the model's inputs for one batch: a tensor, a tuple of positional arguments or a "
        f"dict of keyword arguments. Received: {type(inputs).__name__}. Pass e.g. example_inputs=(x,)."
    )


def _loss_of(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None:
        leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
        loss = leaves[0] if leaves else None
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        found = "a tensor that needs no gradient" if isinstance(loss, torch.Tensor) else type(output).__name__
        raise InputError(
            "The model's output on the example inputs has no tensor to take a backward from. Received: "
            f"{found}. Give the bytes instead: memory_plan(activations=...)."
        )
    return loss if loss.dim() == 0 else loss.sum()
