"""BatchNorm over the global batch: the statistics every replica normalises with are those of the
whole global batch, in the forward and the backward pass, as one device computes them.

Replicas of one process are threads, so torch's `SyncBatchNorm` (which needs a process group) does
not apply. Instead, as `torch.nn.SyncBatchNorm.convert_sync_batchnorm` does, `convert` returns a
copy of the user's model (its parameters and buffers shared, not copied) whose BatchNorm layers are
new layers of a subclass of theirs (`GlobalBatchNorm1d/2d/3d`, so `isinstance(m, nn.BatchNorm2d)`,
`state_dict()` keys and eval mode are as before) holding the same tensors; the replicas are made from
that copy and the user's model and its layers are left as they are. While the strategy runs, a
converted layer's training forward calls `GlobalBatchNormFunction` (batch_norm_function.py):

- forward: each replica contributes its slice's mean and biased variance and its count; the
  replicas of the process meet once at the strategy's `ReplicaBarrier`, where the last to
  arrive builds [sum, sum of squares, count] per channel in float64 and replica order (which
  keeps the float32 case well conditioned), sums it across workers under
  MultiWorkerMirroredStrategy, and derives the global statistics once for every replica
  (so every replica gets the same bits). The layer normalises with the global mean and biased variance and updates its running
  statistics with the global mean and the unbiased global variance, identically everywhere.
- backward: each replica contributes [sum dy, sum dy*x_hat] (x_hat = (x - mean) / sigma with the
  global statistics: torch's sum_dy_xmu over sigma) weighted by its share of the
  global batch (the weight its gradient is combined with), the same meeting sums them, and
  each replica's input gradient is that of the global loss divided by its own weight, so that
  after the weighted gradient combination every parameter gets one device's gradient. With
  `sg.set_loss_weight` the weight is the declared count (the total it is later divided by cancels
  out); a weight of 0 on a slice that holds examples is refused, since the gradient those examples
  get through the global statistics cannot pass a combination that multiplies it by 0.

With `batch_norm="per_replica"` (TensorFlow's default, no meetings) each replica normalises with
its own slice's statistics and keeps its own running statistics, which then differ between
replicas; `state_dict()` and evaluation read replica 0's.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from stratagem.diagnose import PlacementDecision
from stratagem.errors import InputError
from stratagem.strategies.data_parallel.batch_norm_function import Call, Combine, GlobalBatchNormFunction
from stratagem.strategies.data_parallel.cpu_threads import batch_norm_native
from stratagem.strategies.data_parallel.empty_slices import standing_in
from stratagem.strategies.data_parallel.replicas import ReplicaBarrier
from stratagem.strategies.replica_context import current_replica_context

if TYPE_CHECKING:
    from stratagem.strategies.base import Strategy

BATCH_NORM_MODES = ("global", "per_replica")
CrossWorkerSum = Callable[[torch.Tensor, str, int], None]
"""Sums a tensor in place across worker processes: (tensor, what, step)."""


def check_batch_norm_mode(mode: Any) -> str:
    """`mode` when it is one of `BATCH_NORM_MODES`; an `InputError` otherwise."""
    if mode not in BATCH_NORM_MODES:
        raise InputError(
            f"batch_norm must be one of {BATCH_NORM_MODES}. Received: batch_norm={mode!r}. Use 'global' (statistics "
            "of the whole global batch, as on one device) or 'per_replica' (each replica's own slice, cheaper)."
        )
    return mode


def batch_norm_decision(mode: str) -> PlacementDecision:
    """The decision `explain()` shows for `mode`."""
    if mode == "global":
        why = (
            "each BatchNorm layer normalises with the mean and variance of the whole global batch, forward and "
            "backward, so training equals one device and every replica holds the same running statistics "
            "(the ones state_dict() and evaluation read); batch_norm='per_replica' is cheaper"
        )
        return PlacementDecision(subject="BatchNorm statistics", choice="global batch", reason=why)
    why = (
        "batch_norm='per_replica': each replica normalises with its own slice's statistics and keeps its own "
        "running statistics (TensorFlow's default; no exchange), so the result differs from one device and "
        "state_dict() and evaluation read replica 0's running statistics"
    )
    return PlacementDecision(subject="BatchNorm statistics", choice="per replica", reason=why)


def batch_norm_layers(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """The BatchNorm layers of `model` this module synchronises, by name (torch's SyncBatchNorm excluded)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
    ]


class _SyncLink:
    """Where converted layers find the part that synchronises them (None before `attach`, after `remove`).
    Shared by every replica made from a converted model (deepcopy keeps it); a pickled layer gets a link of
    its own, to nothing: it runs as a plain layer."""

    def __init__(self) -> None:
        self.sync: BatchNormSync | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> _SyncLink:
        return self

    def __reduce__(self) -> Any:
        return (_SyncLink, ())


class _Converted:
    """What a converted layer adds to its BatchNorm class: its training forward goes to the part."""

    _link: _SyncLink
    _layer: int
    _plain: type[_BatchNorm]

    def _bind(self, link: _SyncLink, layer: int, plain: type[_BatchNorm]) -> None:
        """Set once, right after `__init__`: where the part is found, which layer this is, the class it replaces."""
        self._link, self._layer, self._plain = link, layer, plain

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        module: Any = self
        sync = self._link.sync
        if sync is None:
            return self._plain.forward(module, input)  # the strategy is closed: the layer as written
        return sync._forward(self._layer, module, input)


class GlobalBatchNorm1d(_Converted, nn.BatchNorm1d):
    """A BatchNorm1d whose statistics, inside a strategy's step, are those of the global batch."""


class GlobalBatchNorm2d(_Converted, nn.BatchNorm2d):
    """A BatchNorm2d whose statistics, inside a strategy's step, are those of the global batch."""


class GlobalBatchNorm3d(_Converted, nn.BatchNorm3d):
    """A BatchNorm3d whose statistics, inside a strategy's step, are those of the global batch."""


class GlobalBatchNorm(_Converted, _BatchNorm):
    """Any other BatchNorm class (a user's subclass of `_BatchNorm`): its input check and plain forward are
    its class's; it is an instance of torch's `_BatchNorm` only, as `convert_sync_batchnorm` makes it."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        self._plain._check_input_dim(self, input)  # type: ignore[arg-type]


_CONVERTED: dict[type[_BatchNorm], type[_BatchNorm]] = {
    nn.BatchNorm1d: GlobalBatchNorm1d,
    nn.BatchNorm2d: GlobalBatchNorm2d,
    nn.BatchNorm3d: GlobalBatchNorm3d,
}


def _convert_layer(layer: _BatchNorm, link: _SyncLink, index: int) -> _BatchNorm:
    """A new layer holding `layer`'s parameters and buffers (the same tensors), built by its class's `__init__`,
    as `convert_sync_batchnorm` builds its layers."""
    plain = type(layer)
    cls = next((c for base, c in _CONVERTED.items() if plain is base), GlobalBatchNorm)
    new: Any = cls(layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats)
    if layer.affine:
        new.weight, new.bias = layer.weight, layer.bias
    if layer.track_running_stats:
        new.running_mean, new.running_var = layer.running_mean, layer.running_var
        new.num_batches_tracked = layer.num_batches_tracked
    new.train(layer.training)
    new._bind(link, index, plain)
    return new


def convert(model: nn.Module, link: _SyncLink, first: int = 0, *, in_place: bool = False) -> nn.Module:
    """`model` when it has no BatchNorm layer; else a copy of it (every parameter and buffer shared with it, the
    modules new; `in_place`: `model` itself) whose BatchNorm layers are converted ones linked to `link`, numbered
    from `first`."""
    if not batch_norm_layers(model):
        return model
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    copy_ = model if in_place else copy.deepcopy(model, shared)
    layers = batch_norm_layers(copy_)
    if layers[0][0] == "":  # the model is one BatchNorm layer
        return _convert_layer(layers[0][1], link, first)
    for index, (name, layer) in enumerate(layers, start=first):
        parent_name, _, child = name.rpartition(".")
        setattr(copy_.get_submodule(parent_name), child, _convert_layer(layer, link, index))
    return copy_


class BatchNormSync:
    """The BatchNorm part of a data-parallel strategy: which statistics BatchNorm layers use, the
    meetings that exchange them, and what `explain()` says about it.

    Args:
        mode: "global" or "per_replica" (see the module docstring).
        strategy: the strategy whose replica contexts count as its replicas.
        barrier: where the local replicas meet.
        num_local: the replicas of this process.
        num_replicas_in_sync: across every worker (1: nothing to synchronise, the layers stay as they are).
        weight: the combination weight of a local replica in the running step (None outside a step).
        step: the number of the running step, for errors.
        cross_worker_sum: sums across workers (MultiWorkerMirroredStrategy), or None.
    """

    def __init__(
        self,
        mode: str,
        *,
        strategy: Strategy,
        barrier: ReplicaBarrier,
        num_local: int,
        num_replicas_in_sync: int,
        weight: Callable[[int], float | None],
        step: Callable[[], int],
        cross_worker_sum: CrossWorkerSum | None = None,
    ) -> None:
        self.mode = check_batch_norm_mode(mode)
        self._strategy = strategy
        self._barrier = barrier
        self._num_local = num_local
        self._num_in_sync = num_replicas_in_sync
        self._weight = weight
        self._step = step
        self._cross_worker_sum = cross_worker_sum
        self._names: list[str] = []
        self._channels: list[int] = []
        self._link = _SyncLink()
        self._timing = _MeetingTimes(num_local)
        self._native: batch_norm_native.NativeMeetings | None = None  # set by the first `attach` that can
        self._native_reason = "the replicas have not been made yet"
        self.attached = False
        """Whether a model was distributed (its BatchNorm layers, if any, are known)."""
        self.begin_step()

    # ---- set-up -------------------------------------------------------------------------------
    def convert(self, model: nn.Module, *, in_place: bool = False) -> nn.Module:
        """What the replicas are made from: with several replicas in sync, `convert(model)` (a copy sharing the
        user's parameters and buffers, its BatchNorm layers converted; `in_place`: `model`'s own layers swapped);
        otherwise `model` itself."""
        if self._num_in_sync == 1:
            return model
        return convert(model, self._link, len(self._names), in_place=in_place)

    def attach(self, replicas: Sequence[nn.Module]) -> None:
        """Links the converted layers of the replicas to this part; their names and widths follow earlier models'."""
        layers = batch_norm_layers(replicas[0])  # (lazy layers fail before this: torch's own error)
        self.attached = True
        self._names += [name for name, _ in layers]
        self._channels += [m.num_features for _, m in layers]
        if self._num_in_sync > 1:
            self._link.sync = self
            if self.mode == "global" and layers and self._native is None:
                self._choose_native(replicas)

    def _choose_native(self, replicas: Sequence[nn.Module]) -> None:
        """Whether the layers' meetings run in C++ (batch_norm_native.py): every replica's tensors on a CPU, so that
        every replica takes the same kind of meeting at each layer, and the extension built."""
        elsewhere = {str(t.device) for r in replicas for t in [*r.parameters(), *r.buffers()] if t.device.type != "cpu"}
        if elsewhere:
            self._native_reason = f"as replicas hold tensors on {', '.join(sorted(elsewhere))}"
            return
        module, reason = batch_norm_native.extension()
        if module is None:
            self._native_reason = f"as {reason}"
            return
        self._native = batch_norm_native.NativeMeetings(module, self, self._barrier, self._num_local)

    @property
    def sums_across_workers(self) -> bool:
        """Whether the last replica to arrive at a meeting also sums across workers."""
        return self._cross_worker_sum is not None

    def remove(self) -> None:
        """Unlinks the converted layers (the strategy is closed): they run as their plain class does."""
        self._link.sync = None

    def begin_step(self) -> None:
        """Called at the start of each run: every replica's meetings count from zero."""
        self._exchanges = [0] * self._num_local
        self._slots: list[list[Any]] = [[None] * self._num_local, [None] * self._num_local]
        self._results: list[Any] = [None, None]
        self._collect_native_times()  # the previous step's, before the clock starts again
        self._timing.begin_step()
        if self._native is not None:
            self._native.begin_step(self._step(), timed=self._timing.step is None)

    def _collect_native_times(self) -> None:
        if self._native is not None and self._timing.step is None:
            times = self._native.times()
            if times is not None:
                self._timing.absorb(*times)

    # ---- explain ------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """BatchNorm layers of the models distributed so far."""
        return len(self._names)

    def describe(self) -> dict[str, str]:
        """What each BatchNorm layer costs per step (empty before `distribute` or without BatchNorm)."""
        if not self._names:
            return {}
        if self.mode == "per_replica" or self._num_in_sync == 1:
            return {
                "BatchNorm layers": f"{len(self._names)} layer(s), statistics of each replica's own slice, "
                "nothing exchanged"
            }
        across = " (the last to arrive also sums across workers)" if self._cross_worker_sum is not None else ""
        costs = "; ".join(
            f"{name or '(model)'}: {2 * c + 1} + {2 * c} float64 values" for name, c in zip(self._names, self._channels)
        )
        total = sum(4 * c + 1 for c in self._channels) * 8
        described = {
            "BatchNorm layers": (
                f"{len(self._names)} layer(s), each training call sums [sum, sum of squares, count] per channel in "
                f"forward and [sum dy, sum dy*x_hat] in backward over every replica: one meeting of the local "
                f"replicas each way{across}; {total} bytes per step ({costs}); the meetings run "
                f"{batch_norm_native.describe(self._native, self._native_reason)}"
            )
        }
        self._collect_native_times()
        measured = self._timing.describe()
        if measured is not None:
            described["BatchNorm meetings"] = measured
        return described

    # ---- the forward a layer gets -------------------------------------------------------------
    def _forward(self, layer: int, module: _BatchNorm, input: torch.Tensor) -> torch.Tensor:
        ctx = current_replica_context()
        plain = getattr(module, "_plain", type(module)).forward
        if ctx is None or ctx.strategy is not self._strategy:
            return plain(module, input)  # outside a step (evaluation on replica 0, a summary): the layer as written
        use_batch_stats = module.training or (module.running_mean is None and module.running_var is None)
        if not use_batch_stats:
            return plain(module, input)  # eval mode with running statistics: nothing depends on the other replicas
        module._check_input_dim(input)
        replica = ctx.replica_id_in_sync_group
        if self.mode == "per_replica":
            if standing_in():
                return _normalise_stand_in(module, input)
            per_replica_check(module, input, replica, self.layer_name(layer))
            return plain(module, input)
        factor = _update_factor(module)
        if self._native is not None and batch_norm_native.takes(module, input):
            # By local index, as `meet` counts them: one replica a process (ShardedStrategy) is 0, whatever its rank.
            local = replica if self._num_local > 1 else 0
            return self._native.forward(layer, module, input, local, standing_in(), factor)
        call = Call(self, layer, replica, standing_in(), module.eps)
        return GlobalBatchNormFunction.apply(
            input,
            module.weight,
            module.bias,
            call,
            module.running_mean if module.training else None,
            module.running_var if module.training else None,
            factor,
        )

    # ---- the meeting --------------------------------------------------------------------------
    def meet(self, replica: int, contribution: Any, what: str, combine: Combine) -> Any:
        """What `combine` makes of every local replica's `contribution` (in replica order), run once by the last
        replica to arrive; each replica calls this in the same order. The first step's meetings are timed."""
        step = self._step()
        timed = self._timing.step in (None, step)
        start = time.perf_counter_ns() if timed else 0
        if self._num_local == 1:
            result = combine([contribution], step)
        else:
            count = self._exchanges[replica]
            self._exchanges[replica] = count + 1
            # Two sets of slots: a replica that runs ahead writes the next meeting's slot while a slow one may
            # still read this one's result; the one after next needs every replica past the next meeting, so past
            # reading this one.
            slots, results = self._slots[count % 2], self._results

            def last() -> None:
                results[count % 2] = combine(list(slots), step)

            slots[replica] = contribution
            self._barrier.wait(replica, what, step, call="the model (and backward())", last=last)
            result = results[count % 2]
        if timed:
            # By local index: one replica per process (ShardedStrategy) is replica 0 here, whatever its rank.
            self._timing.record(0 if self._num_local == 1 else replica, step, start, time.perf_counter_ns())
        return result

    def sum_across_workers(self, total: torch.Tensor, what: str, step: int) -> None:
        """Sums `total` in place across worker processes (MultiWorkerMirroredStrategy); nothing otherwise."""
        if self._cross_worker_sum is not None:
            self._cross_worker_sum(total, what, step)

    def layer_name(self, layer: int) -> str:
        return self._names[layer] or "(model)"

    def weight_of(self, replica: int) -> float | None:
        """The combination weight of local `replica` in the running step."""
        return self._weight(replica)

    def weight_declared(self, replica: int) -> None:
        """Local `replica` declared a loss weight (`sg.set_loss_weight`): the native meetings ask for it again."""
        if self._native is not None:
            self._native.meeting.forget_weight(replica if self._num_local > 1 else 0)  # by local index, as `meet`

    def step_number(self) -> int:
        return self._step()


class _MeetingTimes:
    """How long each local replica spent in the BatchNorm meetings of the first step that had any (waiting for
    the slowest replica, summing, and across workers), against the time from that step's start to its last
    meeting: what `explain()` reports as the measured cost of exact BatchNorm on the user's model."""

    def __init__(self, num_local: int) -> None:
        self.step: int | None = None
        self.started = 0
        self.meetings = 0
        self.last_end = 0
        self.spent = [0] * num_local

    def begin_step(self) -> None:
        if self.step is None:
            self.started = time.perf_counter_ns()

    def record(self, replica: int, step: int, start: int, end: int) -> None:
        self.step = step
        self.spent[replica] += end - start
        if replica == 0:
            self.meetings += 1
        self.last_end = max(self.last_end, end)

    def absorb(self, step: int, meetings: int, spent: Sequence[int], last_end: int) -> None:
        """Adds what the native meetings measured in `step` (the same clock as `time.perf_counter_ns`)."""
        self.step = step
        self.meetings += meetings
        self.spent = [a + b for a, b in zip(self.spent, spent)]
        self.last_end = max(self.last_end, last_end)

    def describe(self) -> str | None:
        if self.step is None:
            return None
        span = (self.last_end - self.started) / 1e6
        each = ", ".join(f"replica {r}: {ns / 1e6:.1f} ms" for r, ns in enumerate(self.spent))
        return (
            f"measured in step {self.step}: {self.meetings} meetings took {max(self.spent) / 1e6:.1f} ms "
            f"({each}) of the {span:.1f} ms from the step's start to its last BatchNorm meeting, waiting for the "
            "slowest replica at each layer and summing; batch_norm='per_replica' has none (a first step also "
            "holds one-off work, so the share in later steps is usually smaller)"
        )


def _update_factor(module: _BatchNorm) -> float:
    """torch's exponential average factor for this call, counting the batch as torch does (momentum=None:
    a cumulative average)."""
    factor = 0.0 if module.momentum is None else module.momentum
    if module.training and module.track_running_stats and module.num_batches_tracked is not None:
        module.num_batches_tracked.add_(1)
        factor = 1.0 / float(module.num_batches_tracked) if module.momentum is None else module.momentum
    return factor


def per_replica_check(module: _BatchNorm, input: torch.Tensor, replica: int, name: str) -> None:
    """Per-replica statistics of a slice with one value per channel: the clear error (torch's names no replica)."""
    if module.training and input.dim() > 1 and input.numel() // max(input.shape[1], 1) == 1:
        raise InputError(
            f"BatchNorm layer '{name}' normalises with each replica's own statistics (batch_norm='per_replica'), but "
            f"replica {replica}'s slice has one value per channel. Received: input of shape {tuple(input.shape)}. "
            "Use batch_norm='global' (the default), whose statistics cover the whole global batch, or a global "
            "batch of at least two examples per replica."
        )


def _normalise_stand_in(module: _BatchNorm, input: torch.Tensor) -> torch.Tensor:
    """Per-replica statistics on an empty slice's stand-in example (see empty_slices.py): an output that is thrown
    away, so neither the running statistics nor the batch count move, and one example is no error."""
    channels = input.shape[1]
    zeros = torch.zeros(channels, dtype=input.dtype, device=input.device)
    ones = torch.ones(channels, dtype=input.dtype, device=input.device)
    return F.batch_norm(input, zeros, ones, module.weight, module.bias, False, 0.0, module.eps)
