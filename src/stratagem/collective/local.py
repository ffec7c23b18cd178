"""Combining gradients across the replicas of one process.

Every replica thread calls `combine_` at the same point (between two barriers), with the
gradients of every replica and each replica's weight (its share of the global batch). When
`combine_` has returned in every thread, each replica's gradients equal the weighted sum

    g = sum_r weight_r * g_r        (replicas with weight 0 are left out, NaN or not)

which is the gradient of the mean loss over the global batch when each replica's loss is the
mean over its own slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Protocol

import torch

from stratagem.diagnose import PlacementDecision

Grads = Sequence[Sequence[torch.Tensor]]  # grads[replica][parameter]


class LocalReducer(Protocol):
    name: str
    prescale: bool
    """True when every replica must scale its own gradients by its weight before `combine_`."""

    def combine_(self, replica: int, grads: Grads, weights: Sequence[float]) -> None: ...


def _active(weights: Sequence[float]) -> list[int]:
    return [r for r, w in enumerate(weights) if w > 0]


class InMemoryReduce:
    """For replicas that share one memory (logical CPU devices): each replica thread reduces
    1/N of every gradient and writes the result into every replica's gradient.

    No replica reads memory another one writes in the same phase, so two barriers suffice
    and the work is spread over all replica threads.
    """

    name = "in-memory reduction (each replica thread sums 1/N of every gradient)"
    prescale = False

    def combine_(
        self, replica: int, grads: Grads, weights: Sequence[float], skip: AbstractSet[int] = frozenset()
    ) -> None:
        """Combines this replica's share of every gradient but those in `skip` (shares already combined)."""
        num_replicas = len(grads)
        active = _active(weights)
        mine: list[list[torch.Tensor]] = [[] for _ in range(num_replicas)]
        for i, g0 in enumerate(grads[0]):
            if i in skip:
                continue
            if all(g[i].is_contiguous() for g in (grads[k] for k in range(num_replicas))):
                n = g0.numel()
                lo, hi = n * replica // num_replicas, n * (replica + 1) // num_replicas
                if hi > lo:
                    for k in range(num_replicas):
                        mine[k].append(grads[k][i].view(-1)[lo:hi])
            elif i % num_replicas == replica:  # a non-contiguous gradient is reduced whole by one owner
                for k in range(num_replicas):
                    mine[k].append(grads[k][i])
        if not mine[0]:
            return
        acc = mine[replica]
        if len(active) == 2 and replica in active and abs(sum(weights) - 1.0) < 1e-12:
            # Two shares that add up to one: w_a * a + w_b * b == lerp(a, b, w_b), one pass instead of two.
            other = active[1] if active[0] == replica else active[0]
            torch._foreach_lerp_(acc, mine[other], weights[other])
            others: list[int] = []
        elif not active:
            # Every local replica has an empty slice (other workers hold the examples): contribute zeros.
            torch._foreach_zero_(acc)
            others = []
        elif weights[replica] > 0:
            if weights[replica] != 1.0:
                torch._foreach_mul_(acc, weights[replica])
            others = [k for k in active if k != replica]
        else:
            # Our own gradient has weight zero (an empty slice: it may be NaN), so it must not be read.
            torch._foreach_copy_(acc, mine[active[0]])
            torch._foreach_mul_(acc, weights[active[0]])
            others = active[1:]
        for k in others:
            torch._foreach_add_(acc, mine[k], alpha=weights[k])
        for k in range(num_replicas):
            if k != replica:
                torch._foreach_copy_(mine[k], acc)


class ReduceToOneDevice:
    """Sums pre-scaled gradients on the first replica's device, then copies the sum back.

    Works for any mix of devices; the fallback when NCCL cannot be used.
    """

    name = "reduction to one device (sum on the first replica's device, then copy back)"
    prescale = True

    def combine_(self, replica: int, grads: Grads, weights: Sequence[float]) -> None:
        if replica != 0:
            return
        target = grads[0]
        for k in range(1, len(grads)):
            torch._foreach_add_(list(target), [_copy_to(g, t.device) for g, t in zip(grads[k], target)])
        for k in range(1, len(grads)):
            for g, t in zip(grads[k], target):
                g.copy_(t, non_blocking=g.device.type == "cuda")


def _copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`, safe to read at once.

    A copy to a GPU may be non-blocking: it is ordered on the GPU's stream before the kernels that read it.
    A copy from a GPU to the CPU must block: with non_blocking=True the call returns before the bytes have
    landed, and the CPU add that follows would read what the memory held before (PyTorch's pinned-memory
    notes warn of exactly this).
    """
    return tensor.to(device, non_blocking=device.type == "cuda")


class NcclReduce:
    """All-reduce of pre-scaled gradients with NCCL (`torch.cuda.nccl`), one call per bucket."""

    name = "NCCL all-reduce (torch.cuda.nccl, one process, every replica on its own GPU)"
    prescale = True

    def __init__(self, bucket_bytes: int = 25 * 1024 * 1024) -> None:
        self.bucket_bytes = bucket_bytes

    def combine_(self, replica: int, grads: Grads, weights: Sequence[float]) -> None:
        if replica != 0:
            return
        from torch.cuda import nccl

        # Flatten into buckets of one dtype so NCCL gets few large calls instead of many small ones.
        num_params = len(grads[0])
        start = 0
        while start < num_params:
            end, size, dtype = start, 0, grads[0][start].dtype
            while end < num_params and grads[0][end].dtype == dtype and (end == start or size < self.bucket_bytes):
                size += grads[0][end].numel() * grads[0][end].element_size()
                end += 1
            flats = [torch._utils._flatten_dense_tensors(list(g[start:end])) for g in grads]
            nccl.all_reduce(flats)
            for g, flat in zip(grads, flats):
                torch._foreach_copy_(
                    list(g[start:end]), torch._utils._unflatten_dense_tensors(flat, list(g[start:end]))
                )
            start = end


def choose_local_reducer(
    physical_devices: Sequence[torch.device], *, nccl_available: bool
) -> tuple[LocalReducer, PlacementDecision]:
    """Picks how the replicas of one process combine gradients, and says why."""
    kinds = {d.type for d in physical_devices}
    if kinds == {"cpu"}:
        return InMemoryReduce(), PlacementDecision(
            subject="gradient combination",
            choice="in-memory",
            reason="every replica is a logical CPU device sharing this process's memory, so each replica "
            "thread sums a slice of every gradient in place (no copies through a process group)",
        )
    distinct_gpus = len({d for d in physical_devices}) == len(physical_devices)
    if kinds == {"cuda"} and distinct_gpus and len(physical_devices) > 1 and nccl_available:
        return NcclReduce(), PlacementDecision(
            subject="gradient combination",
            choice="nccl",
            reason=f"every replica is on its own GPU ({len(physical_devices)} GPUs) and NCCL is available",
        )
    if kinds == {"cuda"} and not nccl_available:
        why = "NCCL is not available in this torch build, so gradients are summed on the first GPU and copied back (slower)"
    elif kinds == {"cuda"}:
        why = "several replicas share one physical GPU, which NCCL cannot all-reduce across"
    else:
        why = f"the replicas mix device types ({', '.join(sorted(kinds))})"
    return ReduceToOneDevice(), PlacementDecision(
        subject="gradient combination", choice="reduce-to-one-device", reason=why
    )
