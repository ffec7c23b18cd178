"""The autograd function of a BatchNorm layer whose statistics are those of the global batch, and the sums
the replicas' contributions are combined with (batch_norm.py holds the layers and the meetings).

Each training call meets the other replicas once in forward and once in backward. A replica brings only
what its own slice gives (its mean and biased variance, or its two backward sums, in the input's dtype);
the last replica to arrive at the meeting combines every contribution once, in replica order and in
float64, sums across workers when there are several, and derives what every replica then uses (the global
mean and variance in the statistics' dtype, the running-statistics updates, the backward's per-replica
coefficients). The others wake to a finished result: nothing is computed twice, and the little work
around a meeting, which two replica threads would otherwise do one after the other under Python's global
lock, is done once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from stratagem.errors import InputError

Combine = Callable[[Sequence[Any], int], Any]
"""Run once per meeting, by the last replica to arrive: (every replica's contribution in replica order,
step) -> the result every replica gets."""


class StatisticsMeeting(Protocol):
    """What the autograd function asks of the part that synchronises the layers (`BatchNormSync`)."""

    def meet(self, replica: int, contribution: Any, what: str, combine: Combine) -> Any: ...

    def sum_across_workers(self, total: torch.Tensor, what: str, step: int) -> None: ...

    def layer_name(self, layer: int) -> str: ...

    def weight_of(self, replica: int) -> float | None: ...

    def step_number(self) -> int: ...


@dataclass
class Call:
    """One replica's call of one layer, as its forward and backward see it."""

    sync: StatisticsMeeting
    layer: int
    replica: int
    standing_in: bool
    eps: float


@dataclass
class ForwardStatistics:
    """What every replica normalises with, computed once per meeting."""

    mean: torch.Tensor  # in the statistics' dtype
    var: torch.Tensor  # biased, in the statistics' dtype
    running_mean: torch.Tensor  # the global mean, in float64 (cast to each buffer's dtype)
    running_var: torch.Tensor  # the unbiased global variance, in float64
    size: float  # values per channel over the global batch


def _sum_forward(contributions: Sequence[Any], channels: int, device: torch.device) -> torch.Tensor:
    """[sum, sum of squares, count] per channel over the contributions, in float64 and replica order; each
    contribution is None (no example) or (count, stacked mean and biased variance): the sums built from a
    stable mean and variance keep the float32 case well conditioned."""
    total = torch.zeros(2 * channels + 1, dtype=torch.float64, device=device)
    for contribution in contributions:
        if contribution is None:
            continue
        count, stats = contribution
        mean_var = stats.to(device=device, dtype=torch.float64)
        mean = mean_var[0]
        total[:channels].add_(mean, alpha=count)
        total[channels : 2 * channels].add_(torch.addcmul(mean_var[1], mean, mean), alpha=count)
        total[-1] += count
    return total


def _forward_statistics(total: torch.Tensor, channels: int, stats_dtype: torch.dtype, where: str) -> ForwardStatistics:
    size = float(total[-1])
    if size <= 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got {int(size)} over the global batch in {where}."
        )
    mean64 = total[:channels] / size
    var64 = (total[channels : 2 * channels] / size - mean64 * mean64).clamp_(min=0)
    return ForwardStatistics(
        mean=mean64.to(stats_dtype),
        var=var64.to(stats_dtype),
        running_mean=mean64,
        running_var=var64 * (size / (size - 1)),
        size=size,
    )


class GlobalBatchNormFunction(torch.autograd.Function):
    """Batch normalisation with statistics summed over every replica (see the module docstring).

    The element-wise passes are torch's own fused kernels: the local mean and variance from
    `batch_norm_update_stats`, the output from eval-mode `batch_norm` given the global mean and
    variance, the local sums of the backward pass from eval-mode `native_batch_norm_backward`
    (which then skips the input gradient), and the input gradient from one more eval-mode
    `batch_norm` of the input plus `dy` scaled; a written-out version took five times as long.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        call: Call,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        factor: float,
    ) -> torch.Tensor:
        channels = x.shape[1]
        sync = call.sync
        contribution: Any = None
        if not call.standing_in:  # a stand-in example counts as no example
            mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)  # biased variance
            contribution = (x.numel() // channels, torch.stack([mean, var]))
        # Under autocast the input may be bfloat16 while the parameters stay float32: torch's kernels then take
        # statistics of the parameters' dtype.
        stats_dtype = weight.dtype if weight is not None else x.dtype
        name = sync.layer_name(call.layer)
        what = f"BatchNorm statistics of '{name}' (forward)"

        def combine(contributions: Sequence[Any], step: int) -> ForwardStatistics:
            total = _sum_forward(contributions, channels, x.device)
            sync.sum_across_workers(total, what, step)
            where = f"BatchNorm layer '{name}' (input of shape {tuple(x.shape)} on replica {call.replica})"
            return _forward_statistics(total, channels, stats_dtype, where)

        stats: ForwardStatistics = sync.meet(call.replica, contribution, what, combine)
        if running_mean is not None and running_var is not None:
            running_mean.mul_(1 - factor).add_(stats.running_mean.to(running_mean), alpha=factor)
            running_var.mul_(1 - factor).add_(stats.running_var.to(running_var), alpha=factor)
        mean, var = stats.mean.to(x.device), stats.var.to(x.device)
        y = F.batch_norm(x, mean, var, weight, bias, False, 0.0, call.eps)
        ctx.save_for_backward(x, weight, mean, var)
        ctx.call = call
        ctx.size = stats.size
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, weight, mean, var = ctx.saved_tensors
        call: Call = ctx.call
        channels = x.shape[1]
        dy = dy.contiguous()
        # Local sums: sum dy, and sum dy * x_hat (x_hat normalised with the global statistics).
        _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            dy, x, weight, mean, var, None, None, False, call.eps, [False, True, True]
        )
        grad_weight = grad_bias = grad_x = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros_like(sum_dy_xhat) if call.standing_in else sum_dy_xhat
        if ctx.needs_input_grad[2]:
            grad_bias = torch.zeros_like(sum_dy) if call.standing_in else sum_dy
        if ctx.needs_input_grad[0]:
            sync = call.sync
            combination = sync.weight_of(call.replica)
            if combination == 0 and not call.standing_in:
                refuse_zero_weight(call, x)
            share = combination or 0.0
            idle = call.standing_in or share == 0
            contribution = None if idle else (share, torch.stack([sum_dy, sum_dy_xhat]))
            what = f"BatchNorm statistics of '{sync.layer_name(call.layer)}' (backward)"
            size, stats_dtype, device = ctx.size, mean.dtype, x.device

            def combine(contributions: Sequence[Any], step: int) -> torch.Tensor:
                # [sum dy, sum dy * x_hat] weighted by each replica's share of the global batch.
                total = torch.zeros(2, channels, dtype=torch.float64, device=device)
                for c in contributions:
                    if c is not None:
                        total.add_(c[1].to(device=device, dtype=torch.float64), alpha=c[0])
                sync.sum_across_workers(total.view(-1), what, step)
                return total

            total = sync.meet(call.replica, contribution, what, combine)
            if idle:
                grad_x = torch.zeros_like(x)  # a weight-zero replica's gradient is never read
            else:
                # The global loss's gradient divided by this replica's weight, which the combination multiplies back:
                # dx = w/sigma * (dy - a - x_hat * c), a and c the global weighted means of dy and dy * x_hat.
                a_c = (total / (share * size)).to(device=device, dtype=stats_dtype)
                gain = torch.rsqrt(var + call.eps)
                if weight is not None:
                    gain = gain * weight
                scale_shift = a_c.mul_(gain).neg_()
                grad_x = F.batch_norm(x, mean, var, scale_shift[1], scale_shift[0], False, 0.0, call.eps)
                grad_x.addcmul_(dy, gain.reshape(1, -1, *([1] * (x.dim() - 2))))
        return grad_x, grad_weight, grad_bias, None, None, None, None


def refuse_zero_weight(call: Call, x: torch.Tensor) -> None:
    """A loss weight of 0 declared on a slice with examples: through the global statistics those examples move the
    other replicas' losses, a gradient that the combination, multiplying this replica's by 0, would drop."""
    name = call.sync.layer_name(call.layer)
    raise InputError(
        f"BatchNorm layer '{name}' normalises with the statistics of the whole global batch, so the examples of "
        f"replica {call.replica} move every replica's loss, but in step {call.sync.step_number()} replica "
        f"{call.replica} declared a loss weight of 0 with sg.set_loss_weight(), which would drop the gradient they "
        f"get through those statistics. Received: sg.set_loss_weight(0) on a slice of {x.shape[0]} example(s) with "
        "batch_norm='global'. Make each replica's loss its share of the global one (its sum over tokens divided "
        "by the global count, times num_replicas_in_sync) and declare sg.set_loss_weight(1) on every replica, or "
        "use batch_norm='per_replica'."
    )
