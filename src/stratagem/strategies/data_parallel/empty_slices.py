"""Replicas with an empty slice: they never call the user's model on an empty batch, and they still
take part in every collective, with weight zero.

A global batch smaller than the number of replicas (the last, short batch of an epoch, or a tiny
batch) leaves some replicas without examples. Such an idle replica still runs the step function,
with its empty slices, exactly as the busy replicas run it: its `loss.backward()`, clipping,
`optimizer.step()` and `zero_grad()` are those of every other replica. Only the model call is
changed. When the distributed model is called on a replica whose slice is empty, with arguments
whose batch dimension is 0, the model runs instead on a stand-in batch of ONE example (every such
argument replaced by ones of its dtype, shape and device, tied to the empty argument when that
requires a gradient), and the outputs are cut back to zero examples (`out[:0]`; an output without
a batch dimension, such as a loss the model computes itself, becomes `0 * out`). So:

- the model never sees an empty batch (the classic `x.view(x.size(0), -1)` works);
- the step function sees what it would see on one device for zero examples: empty outputs, and a
  mean loss over them that is NaN (torch's mean of nothing);
- every collective happens in the same order as on the busy replicas, because the idle replica runs
  the same graph: BatchNorm's exchanges in forward and backward (its contribution is counted as zero
  examples: see batch_norm.py), the end-of-backward gradient combination and, under
  MultiWorkerMirroredStrategy, the gradient buckets in launch order and the cross-worker sums,
  including on a worker whose replicas are all idle;
- its gradient has weight zero: the combination never reads it (it may be NaN), and once
  `backward()` returns the idle replica holds the combined gradient like every other replica;
- so it ends the step with the same parameters and optimizer state: with private copies its own
  optimizer applies the same combined gradient; with shared parameters (`ShardedOptimizer`) it
  updates its 1/N share of every parameter as usual; under CentralStorageStrategy it calls
  `optimizer.step()`, which the strategy applies once.

What the stand-in costs is one example's forward and backward pass, on steps with an idle replica
only. What it does not cover: code inside the model that keeps state of its own other than
BatchNorm (a counter of the examples seen) counts the stand-in example; a step function that
calls a sub-module directly (`model.module.encoder(x)`) rather than the distributed model calls
it on the empty slice as written. The other design, a replica that skips the step function and
shadows the others' collectives (torch's `Join`), cannot run the user's own code between
`backward()` and `optimizer.step()` (clipping, schedulers), so the idle replica's parameters
would have to be copied in afterwards, and a worker whose replicas are all idle would have to
replay a step it never saw, in the same order as the others.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from stratagem.strategies.data_parallel.step_part import RunState, StepPart
from stratagem.values import flatten, map_structure

_state = threading.local()

RULE = (
    "a replica whose slice is empty runs the step function as the others do, but the model runs on a "
    "one-example stand-in batch whose outputs are cut back to zero examples, so the model never sees an empty "
    "batch; the replica takes part in every collective with weight zero (BatchNorm sums count it as zero "
    "examples) and ends the step with the same parameters and optimizer state"
)


def standing_in() -> bool:
    """Whether this thread is running the model on an empty slice's stand-in example."""
    return getattr(_state, "active", False)


@contextmanager
def _standing_in() -> Iterator[None]:
    previous = standing_in()
    _state.active = True
    try:
        yield
    finally:
        _state.active = previous


class EmptySlices(StepPart):
    """The empty-slice part of a data-parallel strategy: knows each local replica's slice size in
    the running step and calls the model on a stand-in when that size is zero."""

    def __init__(self, num_replicas_in_sync: int = 1) -> None:
        self._sizes: tuple[int, ...] | None = None
        self._num_in_sync = num_replicas_in_sync

    def begin_step(self, state: RunState) -> None:
        """The local replicas' slice sizes in the step that starts (None: not known, never idle)."""
        self._sizes = state.batch_sizes

    def details(self) -> dict[str, str]:
        return {"empty slices": RULE} if self._num_in_sync > 1 else {}

    def end_step(self) -> None:
        self._sizes = None

    def is_idle(self, replica: int | None) -> bool:
        sizes = self._sizes
        return replica is not None and sizes is not None and replica < len(sizes) and sizes[replica] == 0

    def call(self, model: Callable[..., Any], replica: int | None, args: tuple, kwargs: Mapping[str, Any]) -> Any:
        """`model(*args, **kwargs)`, or on an idle replica with an empty batch, the stand-in call."""
        if not self.is_idle(replica) or not any(_is_empty_batch(t) for t in flatten((args, dict(kwargs)))):
            return model(*args, **kwargs)
        stand_args = map_structure(_stand_in, args)
        stand_kwargs = {k: map_structure(_stand_in, v) for k, v in kwargs.items()}
        with _standing_in():
            out = model(*stand_args, **stand_kwargs)
        return map_structure(_no_examples, out)


def _is_empty_batch(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == 0


def _stand_in(value: Any) -> Any:
    if not _is_empty_batch(value):
        return value
    one = torch.ones((1, *value.shape[1:]), dtype=value.dtype, device=value.device)
    # Tied to the empty input (its sum is 0) when that needs a gradient: the model's backward pass is then the
    # busy replicas' one, and the empty input gets its (empty) gradient.
    return one + value.sum() if value.requires_grad else one


def _no_examples(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 0:
        return value * 0
    if value.shape[0] == 1:
        return value[:0]
    # Batch-second layouts ((heads, batch, classes), an RNN's (time, batch, hidden) without batch_first): the
    # stand-in's one example leaves one dimension of size 1, and that one is the batch.
    ones = [d for d, size in enumerate(value.shape) if size == 1]
    if len(ones) == 1:
        return value.narrow(ones[0], 0, 0)
    return value  # no batch dimension to be found (a per-channel statistic, say): as the model returned it
