"""The sum across workers of gradients the local replicas have already combined (several local replicas).

Every worker sends the same layout, whatever its backward pass reached: every trainable parameter's
gradient, then one number per parameter, 1 where this pass reached it on some local replica, then the
loss weights this worker's replicas declared (`sg.set_loss_weight`) and how many declared one. A
parameter the pass did not reach here travels as zeros. One all-reduce carries it all, so the workers
learn without another round trip which parameters the pass reached anywhere and the total weight to
divide by.

Only the parameters the pass reached on some worker are written back: one no worker reached keeps what
it holds (None, or the gradient an earlier pass combined), as the local combination leaves it. One
reached by some workers only (data-dependent control flow) needs, from each worker that did not reach
it, the gradient it holds times its weight (what an earlier pass combined counts in again, as on the
workers that reached it): every worker knows those parameters from the summed numbers, so every worker
makes a second, smaller all-reduce for them, in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def _flat(params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor | None], tail: torch.Tensor) -> torch.Tensor:
    """`params`' gradients (None: zeros) then `tail`, in one buffer (one concatenation, as torch's flatten)."""
    first = params[0]
    zeros = torch.zeros(
        max((p.numel() for p, g in zip(params, grads) if g is None), default=0), dtype=first.dtype, device=first.device
    )
    pieces = [zeros[: p.numel()] if g is None else g.reshape(-1) for p, g in zip(params, grads)]
    return torch.cat([*pieces, tail.to(dtype=first.dtype, device=first.device)])


def _views(params: Sequence[nn.Parameter], flat: torch.Tensor) -> list[torch.Tensor]:
    views, offset = [], 0
    for p in params:
        views.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return views


def sum_gradients_across_workers(
    cw: Any,
    replica_params: Sequence[Sequence[nn.Parameter]],
    reached: Sequence[int],
    weight: float,
    declared: tuple[float, int],
    step: int,
    extra: torch.Tensor | None = None,
) -> tuple[float, int, list[float], list[int]]:
    """Sums the local replicas' combined gradients across workers in place (the replicas hold the same local sum).

    `reached`: the positions of the gradients this worker's local combination combined (the pass reached them);
    `weight`: the sum of the local replicas' weights. Returns (total declared loss weight, number of replicas
    that declared one) across every worker, the sum of `extra` (numbers that ride along, after the counts: the
    step's fingerprint), and the positions of the gradients written back (reached on some worker)."""
    params = replica_params[0]
    if not params:
        return (*declared, [], [])
    mine = set(reached)
    total, num_declared = declared
    n = len(params)
    # Counts ride in the gradients' dtype; float32 keeps integers exact up to 2**24.
    numbers_out = torch.tensor([*(i in mine for i in range(n)), total, num_declared], dtype=torch.float64)
    if extra is not None:
        numbers_out = torch.cat([numbers_out, extra.to(dtype=torch.float64, device="cpu")])
    flat = _flat(params, [p.grad if i in mine else None for i, p in enumerate(params)], numbers_out)
    counts = flat[flat.numel() - numbers_out.numel() :]
    cw.all_reduce_([flat], what="gradient all-reduce", step=step)
    # A host read, so under NCCL a host sync each step: which parameters end with grad None must be known on
    # the host. cw.check() after it: a value read from a collective the watchdog aborted is never used.
    numbers = counts.tolist()
    cw.check()
    users, (total, num_declared), extra_sum = numbers[:n], numbers[n : n + 2], numbers[n + 2 :]
    summed = _views(params, flat)
    world_size = cw.world_size
    some = [i for i, count in enumerate(users) if 0 < count < world_size]
    if some:
        late = [params[i] for i in some]
        own = [None if i in mine or params[i].grad is None else params[i].grad for i in some]
        correction = _flat(late, own, torch.zeros(0))
        if weight == 0:
            correction.zero_()  # an empty slice's gradient may be NaN: never multiplied
        elif weight != 1.0:
            correction.mul_(weight)
        cw.all_reduce_([correction], what="gradient all-reduce of parameters some workers did not reach", step=step)
        for i, value in zip(some, _views(late, correction)):
            summed[i].add_(value)
    combined = [i for i, count in enumerate(users) if count > 0]
    for i in combined:
        for replica in replica_params:
            p = replica[i]
            if p.grad is None:
                p.grad = summed[i].clone()
            else:
                p.grad.copy_(summed[i])
    return float(total), int(round(num_declared)), extra_sum, combined
