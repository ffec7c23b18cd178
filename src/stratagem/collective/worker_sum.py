"""The sum across workers of gradients the local replicas have already combined (several local replicas).

Every worker sends the same layout: every trainable parameter's gradient (zeros for one none of its
replicas used), then one number per parameter, 1 where some local replica used it, then the loss
weights this worker's replicas declared (`sg.set_loss_weight`) and how many declared one. One
all-reduce carries it all, so the workers learn without another round trip which parameters anyone
used and the total weight to divide by. A parameter no worker used keeps `grad is None` everywhere,
as on one device; one used elsewhere only gets the others' sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn


def sum_gradients_across_workers(
    cw: Any,
    replica_params: Sequence[Sequence[nn.Parameter]],
    declared: tuple[float, int],
    step: int,
    extra: torch.Tensor | None = None,
) -> tuple[float, int, list[float]]:
    """Sums every local replica's gradients across workers in place (the replicas hold the same local sum);
    returns (total declared loss weight, number of replicas that declared one) across every worker, and the
    sum of `extra` (numbers that ride along, after the counts: the step's fingerprint)."""
    params = replica_params
    used = [any(replica[i].grad is not None for replica in params) for i in range(len(params[0]))]
    # Used by some local replica: the local combine has given every replica the sum, replica 0 included.
    grads = [cast(torch.Tensor, p.grad) if u else torch.zeros_like(p) for p, u in zip(params[0], used)]
    if not grads:
        return (*declared, [])
    total, num_declared = declared
    # Counts ride in the gradients' dtype; float32 keeps integers exact up to 2**24.
    counts = torch.tensor([*used, total, num_declared], dtype=grads[0].dtype, device=grads[0].device)
    num_extra = 0 if extra is None else extra.numel()
    if extra is not None:
        counts = torch.cat([counts, extra.to(dtype=counts.dtype, device=counts.device)])
    flat = torch._utils._flatten_dense_tensors([*grads, counts])
    cw.all_reduce_([flat], what="gradient all-reduce", step=step)
    *summed, users = torch._utils._unflatten_dense_tensors(flat, [*grads, counts])
    # A host read, so under NCCL a host sync each step: which parameters end with grad None must be known on
    # the host. cw.check() after it: a value read from a collective the watchdog aborted is never used.
    numbers = users.tolist()
    cw.check()
    extra_sum = numbers[len(numbers) - num_extra :] if num_extra else []
    *users_list, total, num_declared = numbers[: len(numbers) - num_extra]
    for i, count in enumerate(users_list):
        if count == 0:
            continue  # nobody used it: every local replica's grad is already None
        for replica in params:
            p = replica[i]
            if p.grad is None:
                p.grad = summed[i].clone()
            else:
                p.grad.copy_(summed[i])
    return float(total), int(round(num_declared)), extra_sum
