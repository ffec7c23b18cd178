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
    invstd: torch.Tensor  # 1 / sqrt(var + eps), in the statistics' dtype (the backward's gain)
    running_mean: torch.Tensor | None  # the global mean, in the running buffers' dtype (None: no buffers)
    running_var: torch.Tensor | None  # the unbiased global variance, in the running buffers' dtype
    size: float  # values per channel over the global batch


def _sum_forward(contributions: Sequence[Any], channels: int, device: torch.device) -> torch.Tensor:
    """[sum, sum of squares, count] per channel over the contributions, in float64; each contribution is None
    (no example) or (count, stacked mean and biased variance): the sums built from a stable mean and variance
    keep the float32 case well conditioned. One stack, one cast and one matrix product for all replicas, in
    replica order (a loop over the replicas cost a dozen small operations each)."""
    total = torch.zeros(2 * channels + 1, dtype=torch.float64, device=device)
    present = [c for c in contributions if c is not None]
    if present:
        stats = torch.stack([c[1].to(device) for c in present]).to(torch.float64)  # (replicas, 2, C)
        stats[:, 1].addcmul_(stats[:, 0], stats[:, 0])  # var + mean^2: the mean of the squares
        counts = torch.tensor([[float(c[0]) for c in present]], dtype=torch.float64, device=device)
        torch.mm(counts, stats.view(len(present), 2 * channels), out=total[: 2 * channels].view(1, -1))
        total[-1] = sum(c[0] for c in present)
    return total


def _forward_statistics(
    total: torch.Tensor,
    channels: int,
    stats_dtype: torch.dtype,
    running_dtype: torch.dtype | None,
    eps: float,
    where: str,
) -> ForwardStatistics:
    size = float(total[-1])
    if size <= 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got {int(size)} over the global batch in {where}."
        )
    mean_var = total[: 2 * channels].view(2, channels) / size  # [mean, mean of the squares] in float64
    mean64, var64 = mean_var[0], mean_var[1]
    var64.addcmul_(mean64, mean64, value=-1).clamp_(min=0)
    stats = mean_var.to(stats_dtype)
    return ForwardStatistics(
        mean=stats[0],
        var=stats[1],
        invstd=torch.rsqrt(stats[1] + eps),
        running_mean=None
        if running_dtype is None
        else stats[0]
        if running_dtype == stats_dtype
        else mean64.to(running_dtype),
        running_var=None if running_dtype is None else (var64 * (size / (size - 1))).to(running_dtype),
        size=size,
    )


class GlobalBatchNormFunction(torch.autograd.Function):
    """Batch normalisation with statistics summed over every replica (see the module docstring).

    The element-wise passes are torch's own fused kernels, as many as plain training BatchNorm takes: the
    local mean and variance from `batch_norm_update_stats` and the output from eval-mode `native_batch_norm`
    given the global mean and variance (plain BatchNorm's training kernel does the same two passes); the local
    sums of the backward pass from eval-mode `native_batch_norm_backward` (which then skips the input gradient),
    and the input gradient from one more eval-mode `native_batch_norm` of the input plus `dy` scaled (torch's
    one-pass `batch_norm_backward_elemt` has no CPU kernel). Everything per channel (casts, the global
    statistics, the backward's coefficients) is computed once per meeting for all replicas, by the last to
    arrive: on small layers the cost is the number of small operations, which the replica threads run one
    after the other under Python's global lock.
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
            mean_var = torch.batch_norm_update_stats(x, None, None, 0.0)  # biased variance
            contribution = (x.numel() // channels, torch.stack(mean_var))
        # Under autocast the input may be bfloat16 while the parameters stay float32: torch's kernels then take
        # statistics of the parameters' dtype.
        stats_dtype = weight.dtype if weight is not None else x.dtype
        tracked = running_mean is not None and running_var is not None
        running_dtype = running_mean.dtype if running_mean is not None and tracked else None
        name = sync.layer_name(call.layer)
        what = f"BatchNorm statistics of '{name}' (forward)"

        def combine(contributions: Sequence[Any], step: int) -> ForwardStatistics:
            total = _sum_forward(contributions, channels, x.device)
            sync.sum_across_workers(total, what, step)
            where = f"BatchNorm layer '{name}' (input of shape {tuple(x.shape)} on replica {call.replica})"
            return _forward_statistics(total, channels, stats_dtype, running_dtype, call.eps, where)

        stats: ForwardStatistics = sync.meet(call.replica, contribution, what, combine)
        if running_mean is not None and running_var is not None:
            if stats.running_mean is not None and stats.running_var is not None:  # set whenever the buffers were passed
                running_mean.lerp_(stats.running_mean.to(running_mean), factor)  # (no copy on the meeting's device)
                running_var.lerp_(stats.running_var.to(running_var), factor)
        mean, var = stats.mean.to(x.device), stats.var.to(x.device)
        y = torch.native_batch_norm(x, weight, bias, mean, var, False, 0.0, call.eps)[0]
        ctx.save_for_backward(x, weight)
        ctx.call, ctx.stats, ctx.mean_var = call, stats, (mean, var)  # read-only, shared by the replicas on one device
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        call: Call = ctx.call
        stats: ForwardStatistics = ctx.stats
        mean, var = ctx.mean_var
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
            contribution = None if idle else BackwardShare(share, sum_dy, sum_dy_xhat)
            what = f"BatchNorm statistics of '{sync.layer_name(call.layer)}' (backward)"
            channels, size, device, dtype = x.shape[1], stats.size, x.device, mean.dtype

            def combine(contributions: Sequence[BackwardShare | None], step: int) -> None:
                present = [c for c in contributions if c is not None]
                _combine_backward(present, channels, size, device, dtype, what, step, sync)

            sync.meet(call.replica, contribution, what, combine)
            if contribution is None:
                grad_x = torch.zeros_like(x)  # a weight-zero replica's gradient is never read
            else:
                # The global loss's gradient divided by this replica's weight, which the combination multiplies back:
                # dx = w/sigma * (dy - a - x_hat * c), a and c the global weighted means of dy and dy * x_hat.
                gain = stats.invstd.to(device)
                if weight is not None:
                    gain = gain * weight
                shift, scale = gain * contribution.coefficients.to(device)  # -(w/sigma * a), -(w/sigma * c)
                grad_x = torch.native_batch_norm(x, scale, shift, mean, var, False, 0.0, call.eps)[0]
                grad_x.addcmul_(dy, gain.view(1, -1, *([1] * (x.dim() - 2))))
        return grad_x, grad_weight, grad_bias, None, None, None, None


@dataclass
class BackwardShare:
    """One replica's contribution to a backward meeting, and what the meeting hands back to it."""

    share: float  # its combination weight
    sum_dy: torch.Tensor
    sum_dy_xhat: torch.Tensor
    coefficients: Any = None  # set by the meeting: -(a, c) over this replica's share, shape (2, channels)


def _combine_backward(
    present: list[BackwardShare],
    channels: int,
    size: float,
    device: torch.device,
    dtype: torch.dtype,
    what: str,
    step: int,
    sync: StatisticsMeeting,
) -> None:
    """[sum dy, sum dy * x_hat] weighted by each replica's share of the global batch, in float64 and replica order,
    summed across workers; then each present replica's -(a, c) in the statistics' dtype, in one batch of
    operations for all of them."""
    total = torch.zeros(1, 2 * channels, dtype=torch.float64, device=device)
    if present:
        sums = [t.to(device) for c in present for t in (c.sum_dy, c.sum_dy_xhat)]
        stacked = torch.stack(sums).to(torch.float64).view(len(present), 2 * channels)
        shares = torch.tensor([[c.share for c in present]], dtype=torch.float64, device=device)
        torch.mm(shares, stacked, out=total)
    sync.sum_across_workers(total.view(-1), what, step)
    if present:
        # Divided by the global count and by each replica's own share (its gradient is later multiplied by it).
        coefficients = (total.view(1, 2, channels) / shares.view(-1, 1, 1).mul(-size)).to(dtype)
        for c, row in zip(present, coefficients.unbind(0)):
            c.coefficients = row


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
