"""How a parameter server keeps its shards: flat buckets, and the user's optimizer over them.

A bucket holds the shards of one optimizer parameter group and one dtype, in the order they were
created, as views into one flat tensor, with a flat gradient buffer beside it. ``bucket_layout``
gives a worker and its server the same buckets from the same shard list, and ``fingerprint`` lets
the server check that they agree, so a pull or a push names whole buckets (``@0``, ``@1``...)
rather than every shard: one header entry and one block of bytes for 500 small shards.

For the optimizers torch ships that update each element from its own gradient and state alone
(``sharded.ELEMENTWISE_OPTIMIZERS``: SGD, Adam, AdamW...), the optimizer runs over segments of the buckets (runs of
whole shards of about ``SEGMENT_BYTES``), so an update of 500 small shards is a few kernel calls
instead of thousands, with the same arithmetic for every element, and a segment can be updated as
soon as its gradient has arrived, while the rest of a large push is still on the wire
(``step_ready``). Any other optimizer runs over the shards, one parameter each. A push that carries some shards of a bucket but not all (a parameter that the step did not
use, whose optimizer state torch would leave alone) switches the store for good to per-shard
updates: the buckets' optimizer state is split into per-shard views, and nothing is lost.

    >>> store = ShardStore({"w": torch.ones(2, 3), "b": torch.zeros(3)}, {"w": 0, "b": 0},
    ...                    torch.optim.SGD, [{"lr": 0.5}])
    >>> store.flat, [b.names for b in store.buckets], len(store.buckets[0].segments)
    (True, [['w', 'b']], 1)
    >>> store.buckets[0].grad.fill_(1.0) is not None and store.apply(["@0"]) is None
    True
    >>> store.shards["w"].tolist()
    [[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stratagem.errors import WireFormatError
from stratagem.strategies.data_parallel.cpu_threads.shared_parameters import ELEMENTWISE_OPTIMIZERS

logger = logging.getLogger(__name__)

BUCKET_PREFIX = "@"
SEGMENT_BYTES = 4 << 20
"""A segment closes once it holds this much (a larger shard is a segment of its own)."""


def bucket_layout(entries: Iterable[tuple[str, int, torch.dtype, int]]) -> list[list[tuple[str, int]]]:
    """``(name, group, dtype, numel)`` of each shard, in creation order, grouped into buckets: one per
    (group, dtype), in order of first appearance, each a list of ``(name, numel)``."""
    buckets: dict[tuple[int, torch.dtype], list[tuple[str, int]]] = {}
    for name, group, dtype, numel in entries:
        buckets.setdefault((group, dtype), []).append((name, numel))
    return list(buckets.values())


def fingerprint(entries: Iterable[tuple[str, int, torch.dtype, int]]) -> str:
    """A short digest of the shards' names, groups, dtypes and sizes in order: equal on both ends of a
    pull or push exactly when they mean the same buckets."""
    text = json.dumps([[name, group, str(dtype), numel] for name, group, dtype, numel in entries])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def bucket_name(index: int) -> str:
    return f"{BUCKET_PREFIX}{index}"


@dataclass
class Segment:
    """Consecutive whole shards of a bucket, which the optimizer updates as one parameter."""

    start: int
    stop: int
    """``[start, stop)`` in the bucket's flat tensor."""
    names: list[str] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    """Each shard's ``[start, stop)`` within the segment."""
    shapes: list[torch.Size] = field(default_factory=list)
    param: nn.Parameter | None = None
    grad: torch.Tensor | None = None


def _param(segment: Segment) -> nn.Parameter:
    """A segment's parameter: ShardStore gives every segment one as it builds its buckets."""
    assert segment.param is not None
    return segment.param


def _grad(segment: Segment) -> torch.Tensor:
    """A segment's gradient view: there is one wherever there is an optimizer to step."""
    assert segment.grad is not None
    return segment.grad


@dataclass
class Bucket:
    """The shards of one group and dtype as views of one flat tensor."""

    group: int
    names: list[str]
    values: torch.Tensor
    grad: torch.Tensor
    segments: list[Segment] = field(default_factory=list)


class ShardStore:
    """The shards one parameter server holds, their gradient buffers and the optimizer over them.

    Not thread-safe: the server calls it under its lock. ``build(optimizer_class, param_groups)`` makes the
    optimizer over the store's parameters (again when the store turns to per-shard updates): a parameter
    server passes ``optimizers.build_optimizer`` with the chief's spec, which never calls the class's
    ``__init__``; without it the class is called with the groups, which suits torch's own optimizers given
    bare hyper-parameters (the example above, the store's tests).
    """

    def __init__(
        self,
        values: Mapping[str, torch.Tensor],
        groups: Mapping[str, int],
        optimizer_class: type[torch.optim.Optimizer] | None,
        hypers: Sequence[dict[str, Any]],
        build: Any = None,
    ) -> None:
        self._class = optimizer_class
        self._hypers = list(hypers)
        self._build = build or (lambda cls, param_groups: cls(param_groups))
        entries = [(name, groups[name], value.dtype, value.numel()) for name, value in values.items()]
        self.fingerprint = fingerprint(entries)
        self.buckets: list[Bucket] = []
        self.shards: dict[str, nn.Parameter] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self._bucket_of: dict[str, int] = {}
        self._segment_of: dict[str, Segment] = {}
        for index, members in enumerate(bucket_layout(entries)):
            numel = sum(n for _, n in members)
            dtype = values[members[0][0]].dtype
            flat = torch.empty(numel, dtype=dtype)
            grad = torch.zeros(numel, dtype=dtype) if optimizer_class is not None else torch.empty(0)
            bucket = Bucket(groups[members[0][0]], [name for name, _ in members], flat, grad)
            limit = max(1, SEGMENT_BYTES // flat.element_size())
            start = 0
            for name, n in members:
                value = values[name]
                flat[start : start + n].copy_(value.reshape(-1))
                self.shards[name] = nn.Parameter(flat[start : start + n].view(value.shape))
                if optimizer_class is not None:
                    self.grads[name] = grad[start : start + n].view(value.shape)
                self._bucket_of[name] = index
                if not bucket.segments or bucket.segments[-1].stop - bucket.segments[-1].start >= limit:
                    bucket.segments.append(Segment(start, start))
                segment = bucket.segments[-1]
                segment.names.append(name)
                segment.spans.append((start - segment.start, start - segment.start + n))
                segment.shapes.append(value.shape)
                segment.stop = start + n
                self._segment_of[name] = segment
                start += n
            for segment in bucket.segments:
                segment.param = nn.Parameter(flat[segment.start : segment.stop])
                segment.grad = grad[segment.start : segment.stop] if optimizer_class is not None else None
            self.buckets.append(bucket)
        self._destinations: dict[str, torch.Tensor] | None = None
        self._stepped: set[int] = set()  # id() of the segments this push has already updated
        self._spare: list[list[torch.Tensor]] = []  # snapshot buffers for pulls (list.pop/append are atomic)
        self.flat = optimizer_class in ELEMENTWISE_OPTIMIZERS
        self.optimizer = self._new_optimizer() if optimizer_class is not None and self.shards else None

    # ---- reads ---------------------------------------------------------------------------------
    def snapshot(self) -> list[torch.Tensor]:
        """A copy of every bucket's values, in buffers reused from earlier pulls (give them back with
        ``release``); the caller holds the lock that keeps pushes out while it is taken."""
        buffers = self._spare.pop() if self._spare else [torch.empty_like(b.values) for b in self.buckets]
        for buffer, bucket in zip(buffers, self.buckets):
            buffer.copy_(bucket.values)
        return buffers

    def release(self, buffers: list[torch.Tensor]) -> None:
        """Takes back a snapshot's buffers for later pulls (a few are kept; thread-safe)."""
        if len(self._spare) < 4:
            self._spare.append(buffers)

    # ---- the optimizer -------------------------------------------------------------------------
    def _new_optimizer(self) -> torch.optim.Optimizer:
        param_groups = []
        for index, hyper in enumerate(self._hypers):
            if self.flat:
                params = [seg.param for b in self.buckets if b.group == index for seg in b.segments]
            else:
                params = [self.shards[n] for b in self.buckets if b.group == index for n in b.names]
            if params:
                param_groups.append({"params": params, **hyper})
        return self._build(self._class, param_groups)

    def destinations(self) -> dict[str, torch.Tensor]:
        """Where a push's tensors go: each bucket's gradient buffer (``@i``) and each shard's view of it
        (the same tensors for the store's life, so worked out once)."""
        if self._destinations is None:
            self._destinations = {**{bucket_name(i): b.grad for i, b in enumerate(self.buckets)}, **self.grads}
        return self._destinations

    def step_ready(self, bucket: int, received: int) -> None:
        """Updates, now, the segments of a whole-bucket push whose gradients have fully arrived
        (``received`` elements of bucket ``bucket``), while the rest is still being received."""
        if self.flat and self.optimizer is not None:
            self._step(
                [seg for seg in self.buckets[bucket].segments if seg.stop <= received and id(seg) not in self._stepped]
            )

    def apply(self, names: Sequence[str]) -> None:
        """One optimizer step with the gradients just written for ``names`` (buckets or shards); segments
        already updated by ``step_ready`` during this push are not updated again."""
        try:
            self._apply(names)
        finally:
            self._stepped.clear()

    def apply_buckets(self, grads: Mapping[int, torch.Tensor]) -> None:
        """One optimizer step with a gradient for every shard of the buckets named (index to a flat gradient,
        read where it lies when the optimizer runs over buckets)."""
        if self.optimizer is None:
            raise WireFormatError(
                "This parameter server has no optimizer. Received: a push. Create the "
                "shards with an optimizer (distribute(model, optimizer) on the chief)."
            )
        if self.flat:
            self._step_with(
                [
                    (_param(segment), grad[segment.start : segment.stop])
                    for index, grad in grads.items()
                    for segment in self.buckets[index].segments
                ]
            )
            return
        for index, grad in grads.items():
            self.buckets[index].grad.copy_(grad)
        self.apply([bucket_name(index) for index in grads])

    def _apply(self, names: Sequence[str]) -> None:
        covered: list[set[str]] = [set() for _ in self.buckets]
        for name in names:
            if name.startswith(BUCKET_PREFIX):
                index = int(name[len(BUCKET_PREFIX) :])
                members = self.buckets[index].names
            else:
                index, members = self._bucket_of[name], [name]
            if covered[index].intersection(members):
                raise WireFormatError(
                    f"A push carries a shard twice. Received: {name!r} and a bucket or shard that "
                    "holds the same rows. Send each shard once, by bucket or by name."
                )
            covered[index].update(members)
        if self.optimizer is None:
            raise WireFormatError(
                "This parameter server has no optimizer. Received: a push. Create the "
                "shards with an optimizer (distribute(model, optimizer) on the chief)."
            )
        if self.flat and any(0 < len(c) < len(b.names) for c, b in zip(covered, self.buckets)):
            self._split()
        if self.flat:
            self._step(
                [seg for c, b in zip(covered, self.buckets) if c for seg in b.segments if id(seg) not in self._stepped]
            )
            return
        self._step_with([(self.shards[n], self.grads[n]) for c in covered for n in c])

    def _step(self, segments: list[Segment]) -> None:
        if segments:
            self._stepped.update(id(segment) for segment in segments)
            self._step_with([(_param(segment), _grad(segment)) for segment in segments])

    def _step_with(self, pairs: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """One optimizer step over exactly these parameters: the others have no gradient, so torch skips them."""
        assert self.optimizer is not None  # the pushes that step checked it first
        for param, grad in pairs:
            param.grad = grad
        try:
            self.optimizer.step()
        finally:
            for param, _ in pairs:
                param.grad = None

    def _split(self) -> None:
        """Switches to one optimizer parameter per shard, carrying the segments' state over as views."""
        logger.info(
            "a push left out part of a bucket (a parameter without a gradient): updating shard by shard "
            "from now on, as torch leaves such a parameter's state alone"
        )
        old = self.optimizer
        assert old is not None  # only a push splits, and a push needs the optimizer
        self.flat = False
        self.optimizer = self._new_optimizer()
        for bucket in self.buckets:
            for segment in bucket.segments:
                state = old.state.get(_param(segment))
                if state:
                    for name, span, shape in zip(segment.names, segment.spans, segment.shapes):
                        self.optimizer.state[self.shards[name]] = _slice_state(
                            state, span, shape, _param(segment).numel()
                        )

    # ---- checkpoints ---------------------------------------------------------------------------
    def shard_state(self, name: str) -> dict[str, Any]:
        """The optimizer state of one shard (views of a bucket's state in flat mode)."""
        if self.optimizer is None:
            return {}
        if not self.flat:
            return dict(self.optimizer.state.get(self.shards[name], {}))
        segment = self._segment_of[name]
        state = self.optimizer.state.get(_param(segment))
        if not state:
            return {}
        position = segment.names.index(name)
        return _slice_state(state, segment.spans[position], segment.shapes[position], _param(segment).numel())

    def load_state(self, states: Mapping[str, dict[str, Any]]) -> None:
        """Replaces the optimizer state with per-shard ``states`` (shards not named start fresh)."""
        if self.optimizer is None:
            return
        self.optimizer.state.clear()
        if self.flat:
            segments = [seg for b in self.buckets for seg in b.segments]
            merged = [_merge_state([states.get(n, {}) for n in seg.names], seg) for seg in segments]
            if all(m is not None for m in merged):
                for segment, state in zip(segments, merged):
                    if state:
                        self.optimizer.state[_param(segment)] = state
                return
            self.flat = False  # shards at different points (step counts differ): per-shard from here on
            self.optimizer = self._new_optimizer()
        for name, state in states.items():
            if state:
                self.optimizer.state[self.shards[name]] = dict(state)


def _slice_state(state: Mapping[str, Any], span: tuple[int, int], shape: torch.Size, numel: int) -> dict[str, Any]:
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel:
            out[key] = value[span[0] : span[1]].view(shape)  # per-element state
        elif isinstance(value, torch.Tensor):
            out[key] = value.clone()  # a scalar such as Adam's step count, one per shard from here on
        else:
            out[key] = value
    return out


def _merge_state(states: list[dict[str, Any]], segment: Segment) -> dict[str, Any] | None:
    """One segment's state from its shards' (per-element tensors joined, scalars equal), or None when
    the shards do not agree on their scalars or keys."""
    if not any(states):
        return {}
    if any(set(s) != set(states[0]) for s in states):
        return None
    merged: dict[str, Any] = {}
    for key, first in states[0].items():
        values = [s[key] for s in states]
        if (
            isinstance(first, torch.Tensor)
            and all(isinstance(v, torch.Tensor) and v.shape == shape for v, shape in zip(values, segment.shapes))
            and any(v.dim() > 0 for v in values)
        ):
            merged[key] = torch.cat([v.reshape(-1) for v in values]).to(first.dtype)
        elif all(_equal(v, first) for v in values):
            merged[key] = first.clone() if isinstance(first, torch.Tensor) else first
        else:
            return None
    return merged


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return type(a) is type(b) and a == b
