"""Gradient buckets: fused all-reduces launched while the backward pass is still running.

Parameters are grouped in reverse registration order (roughly the order backward produces
their gradients) into buckets of about `bucket_bytes`, the first one small so communication
starts early. When every gradient of a bucket has arrived (copied and scaled into the
bucket's flat buffer in one pass) the bucket's all-reduce is launched, strictly in bucket
order so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


class GradientBuckets:
    """Buckets over one replica's parameters (those that require grad)."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        *,
        bucket_bytes: int = 25 * 1024 * 1024,
        first_bucket_bytes: int = 1024 * 1024,
    ) -> None:
        self.params = list(params)
        self.buckets: list[list[int]] = []  # parameter indices per bucket
        limit = first_bucket_bytes
        current: list[int] = []
        size = 0
        for i in reversed(range(len(self.params))):
            p = self.params[i]
            nbytes = p.numel() * p.element_size()
            if current and (size + nbytes > limit or p.dtype != self.params[current[0]].dtype or p.device != self.params[current[0]].device):
                self.buckets.append(current)
                current, size, limit = [], 0, bucket_bytes
            current.append(i)
            size += nbytes
        if current:
            self.buckets.append(current)
        self.bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self.flats = [
            torch.zeros(sum(self.params[i].numel() for i in members), dtype=self.params[members[0]].dtype,
                        device=self.params[members[0]].device)
            for members in self.buckets
        ]
        self.views: list[torch.Tensor | None] = [None] * len(self.params)
        for b, members in enumerate(self.buckets):
            offset = 0
            for i in members:
                n = self.params[i].numel()
                self.views[i] = self.flats[b][offset:offset + n].view_as(self.params[i])
                offset += n
        self._pending = [len(m) for m in self.buckets]
        self._arrived = [False] * len(self.params)
        self._next_to_launch = 0
        self._works: list[Any] = []
        self._weight = 1.0

    @property
    def sizes_bytes(self) -> list[int]:
        return [f.numel() * f.element_size() for f in self.flats]

    def start(self, weight: float) -> None:
        """Resets for a backward pass whose gradients are scaled by `weight` (0: contribute zeros)."""
        self._pending = [len(m) for m in self.buckets]
        self._arrived = [False] * len(self.params)
        self._next_to_launch = 0
        self._works = []
        self._weight = weight

    def mark_ready(self, index: int, launch: Callable[[torch.Tensor], Any]) -> None:
        """Gradient `index` has been accumulated: copy it in, launch every bucket that is now complete."""
        if self._arrived[index]:
            return
        self._arrived[index] = True
        self._copy_in(index)
        b = self.bucket_of[index]
        self._pending[b] -= 1
        self._launch_ready(launch)

    def finish(self, launch: Callable[[torch.Tensor], Any]) -> list[Any]:
        """End of backward: buckets with gradients that never came (unused parameters) are launched
        with zeros there; returns the work handles of every bucket, in order."""
        for i, arrived in enumerate(self._arrived):
            if not arrived:
                self._arrived[i] = True
                self._copy_in(i)
                self._pending[self.bucket_of[i]] -= 1
        self._launch_ready(launch)
        return self._works

    def copy_out(self) -> None:
        """Writes the all-reduced buckets back into the parameters' gradients."""
        for i, p in enumerate(self.params):
            view = self.views[i]
            if p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)

    def _copy_in(self, index: int) -> None:
        view = self.views[index]
        grad = self.params[index].grad
        if grad is None or self._weight == 0:
            view.zero_()  # an unused parameter, or an empty slice whose gradient may be NaN
        elif self._weight == 1.0:
            view.copy_(grad)
        else:
            torch.mul(grad, self._weight, out=view)

    def _launch_ready(self, launch: Callable[[torch.Tensor], Any]) -> None:
        while self._next_to_launch < len(self.buckets) and self._pending[self._next_to_launch] == 0:
            self._works.append(launch(self.flats[self._next_to_launch]))
            self._next_to_launch += 1
