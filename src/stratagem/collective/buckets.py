"""Gradient buckets: all-reduces launched while the backward pass is still running.

Parameters are taken in reverse registration order (roughly the order backward produces their
gradients). Small gradients are fused into flat buckets of about `bucket_bytes` (the first one
small, so communication starts early; a bucket closes once it holds its limit or more): each is copied
and weighted into its bucket in one pass as soon as it is ready, and at the end each parameter's
gradient becomes its view of the all-reduced bucket (no copy back). A gradient of at least `direct_bytes` (a
whole bucket, by default) is all-reduced in place instead, in chunks of at most `bucket_bytes`, each chunk weighted just
before its all-reduce starts: no copy in, no copy out, and the weighting of one chunk overlaps
the communication of the previous one. Buckets launch strictly in order, so every rank issues
the same collectives in the same order.

With `count_users=True` the last collective also carries, after the gradients, one number per
parameter: 1 where this rank produced (or already held) its gradient. Summed, it tells every rank
how many ranks used each parameter, so a parameter no rank used ends the step with `grad is None`,
as on one device (torch's optimizers then skip it), and one used by some ranks only gets the sum
of theirs. The last collective starts only once every gradient is in, so the counts are known by
then and cost no extra round trip (when the last bucket holds a direct gradient, a small one of
their own follows it). Two more numbers follow them: the loss weight this rank declared
(`sg.set_loss_weight`) and 1 if it declared one, so that every rank learns the total it divides by.
Then `extra` numbers that the caller fills (`extra_tail`) before the backward pass and reads after the sum:
MultiWorkerMirroredStrategy's fingerprint of the step (strategies/worker_group/agreement.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Launch = Callable[[torch.Tensor], Any]

# Gloo nears its full loopback bandwidth from about 8 MiB per all-reduce (shared/peers/README.md); chunks of a
# bucket's size keep the number of calls low while the weighting of one chunk overlaps the previous one.
_DIRECT_CHUNK_BYTES = 25 * 1024 * 1024
_FIRST_DIRECT_CHUNK_BYTES = 1 * 1024 * 1024


@dataclass
class _Bucket:
    members: list[int]
    direct: bool
    flat: torch.Tensor | None = None
    pending: int = 0
    views: dict[int, torch.Tensor] = field(default_factory=dict)
    wire: torch.Tensor | None = None
    """What is all-reduced when it is not `flat` itself: `flat` followed by the user counts."""


class GradientBuckets:
    """Buckets over one replica's parameters (those that require grad).

    `after_host_read`: called right after each host read of the summed counts (`hand_out`, `declared_total`);
    MultiWorkerMirroredStrategy passes `CrossWorker.check`, which raises when the collective failed.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        *,
        bucket_bytes: int = 25 * 1024 * 1024,
        first_bucket_bytes: int = 1024 * 1024,
        direct_bytes: int | None = None,
        count_users: bool = False,
        after_host_read: Callable[[], None] | None = None,
        extra: int = 0,
    ) -> None:
        # A first bucket of 1 MiB, as DDP's: 128 KiB (the CNN's dense layers sent before its convolutions'
        # gradients exist) measured 2-3% slower a step against an A/A control.
        # A gradient of a whole bucket or more goes direct (None: bucket_bytes). Smaller ones are
        # fused, since each extra all-reduce costs a round trip (about 0.5 ms with Gloo on loopback)
        # that outweighs copying a few MiB.
        direct_bytes = bucket_bytes if direct_bytes is None else direct_bytes
        self.params = list(params)
        # Called right after each host read of the summed counts (CrossWorker.check): raises when the
        # collective that wrote them failed, so a value read from an aborted one is never used.
        self._after_host_read = after_host_read or (lambda: None)
        self.bucket_bytes = bucket_bytes
        self.buckets = _assign(self.params, bucket_bytes, first_bucket_bytes, direct_bytes)
        self._users: torch.Tensor | None = None
        self._declared_tail: torch.Tensor | None = None
        self.extra_tail: torch.Tensor | None = None
        """`extra` numbers after the counts, summed with them (None without counts)."""
        self._declared = False
        self._allocate()
        if count_users and self.params:
            self._allocate_user_counts(extra)
        self._arrived = [False] * len(self.params)
        self._used = [False] * len(self.params)
        self._next_to_launch = 0
        self._works: list[Any] = []
        self._weight = 1.0

    def _allocate(self) -> None:
        """The flat tensor of every fused bucket, and each member gradient's view into it."""
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.members}
        for bucket in self.buckets:
            if bucket.direct:
                continue
            first = self.params[bucket.members[0]]
            bucket.flat = torch.zeros(
                sum(self.params[i].numel() for i in bucket.members), dtype=first.dtype, device=first.device
            )
            offset = 0
            for i in bucket.members:
                n = self.params[i].numel()
                bucket.views[i] = bucket.flat[offset : offset + n].view_as(self.params[i])
                offset += n

    def _allocate_user_counts(self, extra: int) -> None:
        """One number per parameter after the last bucket's gradients (a bucket of its own after a direct one)."""
        n = len(self.params)
        last = self.buckets[-1] if self.buckets else None
        if last is None or last.direct:
            first = self.params[0]
            last = _Bucket([], direct=False, flat=torch.zeros(0, dtype=first.dtype, device=first.device))
            self.buckets.append(last)
        assert last.flat is not None  # every fused bucket got its flat tensor in _allocate, or just above
        size = last.flat.numel()
        last.wire = torch.zeros(size + n + 2 + extra, dtype=last.flat.dtype, device=last.flat.device)
        last.flat = last.wire[:size]
        offset = 0
        for i in last.members:
            numel = self.params[i].numel()
            last.views[i] = last.flat[offset : offset + numel].view_as(self.params[i])
            offset += numel
        self._users = last.wire[size : size + n]
        self._declared_tail = last.wire[size + n : size + n + 2]
        self.extra_tail = last.wire[size + n + 2 :]

    @property
    def sizes_bytes(self) -> list[int]:
        """Bytes of each bucket, in launch order."""
        return [sum(self.params[i].numel() * self.params[i].element_size() for i in b.members) for b in self.buckets]

    def describe(self) -> str:
        parts = [
            f"{'direct ' if b.direct else ''}{n / 2**20:.2f}"
            for b, n in zip(self.buckets, self.sizes_bytes)
            if b.members
        ]
        return ", ".join(parts)

    def start(self, weight: float, declared: bool = False) -> None:
        """Resets for a backward pass whose gradients are scaled by `weight` (0: contribute zeros); `declared`:
        the weight is a loss weight the step declared (a count, sent along with the user counts)."""
        for bucket in self.buckets:
            bucket.pending = len(bucket.members)
        self._arrived = [False] * len(self.params)
        self._used = [False] * len(self.params)
        self._next_to_launch = 0
        self._works = []
        self._weight = weight
        self._declared = declared

    def declare_weight(self, weight: float) -> None:
        """The step declared its loss weight (before its backward pass): gradients are scaled by it instead."""
        self._weight = weight
        self._declared = True

    def declared_total(self) -> tuple[float, int]:
        """After the all-reduce: (sum of the declared loss weights, how many ranks declared one)."""
        if self._declared_tail is None:
            return 0.0, 0
        total, count = self._declared_tail.tolist()  # a host read: a host sync under NCCL (see hand_out)
        self._after_host_read()
        return float(total), int(round(count))

    def mark_ready(self, index: int, launch: Launch) -> None:
        """Gradient `index` has been accumulated: take it in, launch every bucket that is now complete."""
        if self._arrived[index]:
            return
        self._arrived[index] = True
        self._used[index] = True
        bucket = self.buckets[self.bucket_of[index]]
        if not bucket.direct:
            self._copy_in(bucket, index)
        bucket.pending -= 1
        self._launch_ready(launch)

    def finish(self, launch: Launch) -> list[Any]:
        """End of backward: gradients that never came (unused parameters) count as zeros; returns the
        work handles of every launched all-reduce, in order. A parameter that already held a gradient
        (accumulated earlier) counts as used, as torch's optimizers would use it."""
        for i, arrived in enumerate(self._arrived):
            if not arrived:
                self._arrived[i] = True
                self._used[i] = self.params[i].grad is not None
                bucket = self.buckets[self.bucket_of[i]]
                if bucket.direct:
                    if self.params[i].grad is None:
                        self.params[i].grad = torch.zeros_like(self.params[i])
                    # else: the gradient it holds is weighted and summed in place, as a fused one is copied in
                else:
                    self._copy_in(bucket, i)
                bucket.pending -= 1
        self._launch_ready(launch)
        return self._works

    def hand_out(self) -> None:
        """Makes each fused gradient its view of the all-reduced bucket, as DDP's `gradient_as_bucket_view`
        does: no copy back (6.3 MB a step on the MLP workload, about 3% of its step). The view is
        overwritten by the next step's backward pass; a caller keeping a gradient across steps clones it.
        A gradient accumulated in place (zero_grad(set_to_none=False), several backward passes) is then
        already in its bucket, and taking it in is a multiplication in place.

        With user counts, a parameter that no rank used gets `grad = None` instead."""
        # The counts are read on the host, which under NCCL is a host sync each step: whether a parameter ends
        # the step with grad None is a Python attribute, so the host must know who used it.
        unused = set() if self._users is None else {i for i, c in enumerate(self._users.tolist()) if c == 0}
        if self._users is not None:
            self._after_host_read()
        for bucket in self.buckets:
            for i, view in bucket.views.items():
                p = self.params[i]
                if i in unused:
                    p.grad = None
                elif p.grad is not view:
                    p.grad = view
            if bucket.direct and bucket.members[0] in unused:
                self.params[bucket.members[0]].grad = None

    def _copy_in(self, bucket: _Bucket, index: int) -> None:
        view = bucket.views[index]
        grad = self.params[index].grad
        if grad is None or self._weight == 0:
            view.zero_()  # an unused parameter, or an empty slice whose gradient may be NaN
        elif self._weight == 1.0:
            view.copy_(grad)
        else:
            torch.mul(grad, self._weight, out=view)

    def _launch_ready(self, launch: Launch) -> None:
        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].pending == 0:
            bucket = self.buckets[self._next_to_launch]
            if bucket.direct:
                self._launch_direct(self.params[bucket.members[0]], launch)
            elif bucket.wire is not None:
                # Launched last, so every gradient has come by now: this rank's use of each parameter is known.
                # A wire exists only with count_users, and _allocate_user_counts made both views into it.
                assert self._users is not None and self._declared_tail is not None
                self._users.copy_(torch.tensor(self._used, dtype=bucket.wire.dtype))
                self._declared_tail.copy_(
                    torch.tensor(
                        [self._weight if self._declared else 0.0, 1.0 if self._declared else 0.0],
                        dtype=bucket.wire.dtype,
                    )
                )
                self._works.append(launch(bucket.wire))
            else:
                assert bucket.flat is not None  # a fused bucket: _allocate gave it its flat tensor
                self._works.append(launch(bucket.flat))
            self._next_to_launch += 1

    def _launch_direct(self, param: nn.Parameter, launch: Launch) -> None:
        grad = param.grad
        if grad is None or not grad.is_contiguous():
            # A gradient whose layout differs from the parameter's is replaced by a contiguous copy.
            param.grad = grad = torch.zeros_like(param) if grad is None else grad.contiguous()
        flat = grad.view(-1)
        # A small first chunk starts the wire early; later chunks are weighted while earlier ones travel.
        first = max(1, _FIRST_DIRECT_CHUNK_BYTES // grad.element_size())
        chunk = max(1, min(self.bucket_bytes, _DIRECT_CHUNK_BYTES) // grad.element_size())
        start = 0
        while start < flat.numel():
            size = first if start == 0 else chunk
            piece = flat[start : start + size]
            start += size
            if self._weight == 0:
                piece.zero_()
            elif self._weight != 1.0:
                piece.mul_(self._weight)
            self._works.append(launch(piece))


def _assign(
    params: Sequence[nn.Parameter], bucket_bytes: int, first_bucket_bytes: int, direct_bytes: int
) -> list[_Bucket]:
    """Parameters in reverse order, fused into buckets; a gradient of `direct_bytes` or more goes alone.

    A bucket closes as soon as it holds its limit or more (as DDP's do), not before the gradient that
    would overflow it: on the MLP workload the first bucket then holds the last two layers (4 MiB) and
    is on the wire while backward still computes the first layer's gradient, where closing before the
    overflow left one 6 MiB bucket that could only start once backward had finished.
    """
    buckets: list[_Bucket] = []
    limit = first_bucket_bytes
    current: list[int] = []
    size = 0

    def close() -> None:
        nonlocal current, size, limit
        if current:
            buckets.append(_Bucket(current, direct=False))
            current, size, limit = [], 0, bucket_bytes

    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        if nbytes >= direct_bytes and p.is_contiguous():
            close()
            buckets.append(_Bucket([i], direct=True))
            limit = bucket_bytes
            continue
        first = params[current[0]] if current else None
        if first is not None and (p.dtype != first.dtype or p.device != first.device):
            close()
        current.append(i)
        size += nbytes
        if size >= limit:
            close()
    close()
    return buckets
