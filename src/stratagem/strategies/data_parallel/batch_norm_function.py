"""The autograd function of a BatchNorm layer whose statistics are those of the global batch, and the sums
the replicas' contributions are combined with (batch_norm.py holds the layers and the meetings).

Each training call meets the other replicas once in forward and once in backward. A replica brings what its
own slice gives (its count, mean and biased variance; or its two backward sums, weighted by its share) and,
before it arrives, turns it into float64 sums; the last replica to arrive adds every replica's sums, in
replica order, sums across workers when there are several, and derives the global mean and variance (in the
statistics' dtype) and the running-statistics updates once for every replica. The others wake to a finished
result. After the backward meeting each replica derives its own coefficients from the summed values, in
parallel with the others: what sits between the meeting's arrivals and its release is only the addition.

On a CPU, in float32 or float64, that per-channel arithmetic runs in NumPy. It sits between large kernels (a
convolution before, another after), which leave the processor's caches holding their data: measured right
after one, on this project's 2-core machine, each small torch operation cost about 8 us, most of it in
torch's dispatch, and the forward meeting's arithmetic 280-500 us in torch against 120-210 us in NumPy.
Elsewhere (a GPU, where NumPy would mean copying to the host and waiting for the device at every layer;
bfloat16 or float16 statistics) the same arithmetic runs in torch; `tests/test_batch_norm_function.py` checks
that both agree to the rounding of the float64 sums.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
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


@dataclass
class ForwardShare:
    """One replica's contribution to a forward meeting: its slice's count, mean and biased variance (in the
    input's dtype), and, where they are CPU tensors of float32 or float64, the float64 sums built from them."""

    count: int
    mean: torch.Tensor
    var: torch.Tensor
    part: np.ndarray | None  # [sum, sum of squares, count] per channel, from `_forward_part`


@dataclass
class BackwardShare:
    """One replica's contribution to a backward meeting, and what it then computes for itself."""

    share: float  # its combination weight
    sum_dy: torch.Tensor
    sum_dy_xhat: torch.Tensor
    part: np.ndarray | None  # share * [sum dy, sum dy * x_hat] in float64, from `_backward_part` (CPU float only)


_NUMPY_OF: dict[torch.dtype, Any] = {torch.float32: np.float32, torch.float64: np.float64}


def _in_numpy(*tensors: torch.Tensor | None) -> bool:
    """Whether NumPy can do the per-channel work of these tensors: CPU tensors of float32 or float64."""
    return all(t is None or (t.dtype in _NUMPY_OF and t.device.type == "cpu") for t in tensors)


def _on(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`t` in `like`'s dtype and on its device; `t` itself, without a dispatched call, when it already is."""
    return t if t.dtype == like.dtype and t.device == like.device else t.to(like)


def _borrow(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a tensor this module does not own (a layer's weight, the sums that become its gradients),
    for the length of one computation. Not `Tensor.numpy()`: that marks the tensor's storage as never to be
    resized again, which FSDP2 does to the parameters it gathers and frees (and a user may do to a gradient)."""
    return np.from_dlpack(t.detach())


def check_size(size: float, where: str) -> None:
    if size <= 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got {int(size)} over the global batch in {where}."
        )


# ---- forward: the global mean and variance ----------------------------------------------------------------
def _forward_part(share: ForwardShare) -> np.ndarray:
    """One replica's [sum, sum of squares, count] per channel in float64, from its mean and biased variance: the
    sums built from a stable mean and variance keep the float32 case well conditioned. Made by each replica
    before the meeting, so that the last to arrive only adds them."""
    channels = share.mean.shape[0]
    m = share.mean.numpy().astype(np.float64)
    part = np.empty(2 * channels + 1)
    np.multiply(m, share.count, out=part[:channels])
    np.multiply(share.var.numpy() + m * m, share.count, out=part[channels:-1])
    part[-1] = share.count
    return part


def _sum_parts(parts: Sequence[np.ndarray], size: int) -> np.ndarray:
    """The sum of the present replicas' parts, in replica order (zeros of `size` without any)."""
    total = np.zeros(size)
    for part in parts:
        total += part
    return total


def _meeting_sum(
    present: Sequence[ForwardShare] | Sequence[BackwardShare], size: int, in_torch: Callable[[], torch.Tensor]
) -> np.ndarray | torch.Tensor:
    """What the last replica to arrive adds: the present replicas' NumPy parts when every one brought them (all
    on a CPU in float32 or float64), else `in_torch()`, the same sums in torch."""
    parts = [c.part for c in present if c.part is not None]
    return _sum_parts(parts, size) if len(parts) == len(present) else in_torch()


def _sum_forward(present: Sequence[ForwardShare], channels: int, device: torch.device) -> torch.Tensor:
    """`_forward_part`'s sums over the present replicas in torch, where one of them is not on a CPU or not in
    float32 or float64 (a GPU, bfloat16): the same arithmetic, on `device`."""
    total = torch.zeros(2 * channels + 1, dtype=torch.float64, device=device)
    for s in present:
        m = s.mean.to(device, torch.float64)
        total[:channels].add_(m, alpha=s.count)
        total[channels:-1].add_(torch.addcmul(s.var.to(device, torch.float64), m, m), alpha=s.count)
        total[-1] += s.count
    return total


def _forward_statistics(
    total: np.ndarray, channels: int, stats_dtype: torch.dtype, running_dtype: torch.dtype | None, eps: float
) -> ForwardStatistics:
    """The global statistics from the summed `total` (float64): in NumPy when the statistics' and the running
    buffers' dtypes are float32 or float64, the results tensors on NumPy's memory."""
    size = float(total[-1])
    mean_var = total[: 2 * channels].reshape(2, channels) / size  # [mean, mean of the squares]
    mean64, var64 = mean_var[0], mean_var[1]
    var64 -= mean64 * mean64
    np.maximum(var64, 0.0, out=var64)
    dtype = _NUMPY_OF[stats_dtype]
    stats = mean_var.astype(dtype)
    mean = torch.from_numpy(stats[0])
    running_mean = running_var = None
    if running_dtype is not None:
        running = _NUMPY_OF[running_dtype]
        running_mean = mean if running_dtype == stats_dtype else torch.from_numpy(mean64.astype(running))
        running_var = torch.from_numpy((var64 * (size / (size - 1))).astype(running))
    return ForwardStatistics(
        mean=mean,
        var=torch.from_numpy(stats[1]),
        invstd=torch.from_numpy(1 / np.sqrt(stats[1] + dtype(eps))),
        running_mean=running_mean,
        running_var=running_var,
        size=size,
    )


def _forward_statistics_torch(
    total: torch.Tensor, channels: int, stats_dtype: torch.dtype, running_dtype: torch.dtype | None, eps: float
) -> ForwardStatistics:
    """`_forward_statistics` in torch, on `total`'s device (a GPU; bfloat16 or float16 statistics)."""
    size = float(total[-1])
    mean_var = total[: 2 * channels].view(2, channels) / size
    mean64, var64 = mean_var[0], mean_var[1]
    var64.addcmul_(mean64, mean64, value=-1).clamp_(min=0)
    stats = mean_var.to(stats_dtype)
    running_mean = running_var = None
    if running_dtype is not None:
        running_mean = stats[0] if running_dtype == stats_dtype else mean64.to(running_dtype)
        running_var = (var64 * (size / (size - 1))).to(running_dtype)
    return ForwardStatistics(
        mean=stats[0],
        var=stats[1],
        invstd=torch.rsqrt(stats[1] + eps),
        running_mean=running_mean,
        running_var=running_var,
        size=size,
    )


# ---- backward: the input gradient's coefficients ----------------------------------------------------------
def _backward_part(share: float, sum_dy: torch.Tensor, sum_dy_xhat: torch.Tensor) -> np.ndarray:
    """share * [sum dy, sum dy * x_hat] in float64, made by the replica before the meeting."""
    part = np.empty(2 * sum_dy.shape[0])
    half = sum_dy.shape[0]
    np.multiply(_borrow(sum_dy), share, out=part[:half], dtype=np.float64)
    np.multiply(_borrow(sum_dy_xhat), share, out=part[half:], dtype=np.float64)
    return part


def _sum_backward(present: Sequence[BackwardShare], channels: int, device: torch.device) -> torch.Tensor:
    """`_backward_part`'s sums over the present replicas in torch (see `_sum_forward`)."""
    total = torch.zeros(2 * channels, dtype=torch.float64, device=device)
    for s in present:
        total[:channels].add_(s.sum_dy.to(device, torch.float64), alpha=s.share)
        total[channels:].add_(s.sum_dy_xhat.to(device, torch.float64), alpha=s.share)
    return total


def _coefficients(
    total: np.ndarray | torch.Tensor,
    share: float,
    stats: ForwardStatistics,
    weight: torch.Tensor | None,
    like: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """After the backward meeting, on the replica itself: its gain w / sigma (shaped to broadcast over `like`, its
    input), and its shift and scale, -(w / sigma) * (a, c) over its `share`, a and c the global weighted means of
    dy and dy * x_hat; in NumPy where `total` (the summed float64 [sum dy, sum dy * x_hat]) and every tensor are."""
    channels = stats.mean.shape[0]
    shape = (1, channels, *([1] * (like.dim() - 2)))
    if isinstance(total, np.ndarray) and _in_numpy(stats.invstd, weight, like):
        row = (total.reshape(2, channels) / (share * -stats.size)).astype(_NUMPY_OF[stats.mean.dtype])
        gain = stats.invstd.numpy()
        if weight is not None:
            gain = gain * _borrow(weight)
        shift_scale = gain * row
        return torch.from_numpy(gain.reshape(shape)), torch.from_numpy(shift_scale[0]), torch.from_numpy(shift_scale[1])
    summed = torch.as_tensor(total).to(like.device)
    row_t = (summed.view(2, channels) / (share * -stats.size)).to(stats.mean.dtype)
    gain_t = stats.invstd.to(like.device)
    if weight is not None:
        gain_t = gain_t * weight.detach()
    shift, scale = gain_t * row_t
    return gain_t.view(shape), shift, scale


class GlobalBatchNormFunction(torch.autograd.Function):
    """Batch normalisation with statistics summed over every replica (see the module docstring).

    The element-wise passes are torch's own fused kernels, as many as plain training BatchNorm takes: the
    local mean and variance from `batch_norm_update_stats` and the output from eval-mode `native_batch_norm`
    given the global mean and variance (plain BatchNorm's training kernel does the same two passes); the local
    sums of the backward pass from eval-mode `native_batch_norm_backward` (which then skips the input gradient),
    and the input gradient from one more eval-mode `native_batch_norm` of the input plus `dy` scaled (torch's
    one-pass `batch_norm_backward_elemt` has no CPU kernel). Measured alone on one thread, those four kernels
    take as long as plain BatchNorm's two (most of either is the pass that computes the slice's statistics).
    What exactness adds is the per-channel work around the meetings (see the module docstring) and the
    meetings themselves.
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
        contribution: ForwardShare | None = None
        if not call.standing_in:  # a stand-in example counts as no example
            mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)  # biased variance
            contribution = ForwardShare(x.numel() // channels, mean, var, None)
            if _in_numpy(mean, var):
                contribution.part = _forward_part(contribution)
        # Under autocast the input may be bfloat16 while the parameters stay float32: torch's kernels then take
        # statistics of the parameters' dtype.
        stats_dtype = weight.dtype if weight is not None else x.dtype
        tracked = running_mean is not None and running_var is not None
        running_dtype = running_mean.dtype if running_mean is not None and tracked else None
        name = sync.layer_name(call.layer)
        what = f"BatchNorm statistics of '{name}' (forward)"

        def combine(contributions: Sequence[ForwardShare | None], step: int) -> ForwardStatistics:
            present = [c for c in contributions if c is not None]
            total = _meeting_sum(present, 2 * channels + 1, lambda: _sum_forward(present, channels, x.device))
            sync.sum_across_workers(torch.as_tensor(total), what, step)
            check_size(
                float(total[-1]),
                f"BatchNorm layer '{name}' (input of shape {tuple(x.shape)} on replica {call.replica})",
            )
            if isinstance(total, np.ndarray) and stats_dtype in _NUMPY_OF and running_dtype in (None, *_NUMPY_OF):
                return _forward_statistics(total, channels, stats_dtype, running_dtype, call.eps)
            return _forward_statistics_torch(torch.as_tensor(total), channels, stats_dtype, running_dtype, call.eps)

        stats: ForwardStatistics = sync.meet(call.replica, contribution, what, combine)
        if running_mean is not None and running_var is not None:
            if stats.running_mean is not None and stats.running_var is not None:  # set whenever the buffers were passed
                running_mean.lerp_(_on(stats.running_mean, running_mean), factor)  # (no copy on the meeting's device)
                running_var.lerp_(_on(stats.running_var, running_var), factor)
        mean = stats.mean if stats.mean.device == x.device else stats.mean.to(x.device)
        var = stats.var if stats.var.device == x.device else stats.var.to(x.device)
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
        if not dy.is_contiguous():
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
                refuse_zero_weight(sync, call.layer, call.replica, x.shape[0])
            share = combination or 0.0
            contribution = None
            if not (call.standing_in or share == 0):
                part = _backward_part(share, sum_dy, sum_dy_xhat) if _in_numpy(sum_dy) else None
                contribution = BackwardShare(share, sum_dy, sum_dy_xhat, part)
            what = f"BatchNorm statistics of '{sync.layer_name(call.layer)}' (backward)"
            channels, device = x.shape[1], x.device

            def combine(contributions: Sequence[BackwardShare | None], step: int) -> np.ndarray | torch.Tensor:
                present = [c for c in contributions if c is not None]
                total = _meeting_sum(present, 2 * channels, lambda: _sum_backward(present, channels, device))
                sync.sum_across_workers(torch.as_tensor(total), what, step)  # in place, NumPy's memory too
                return total

            total = sync.meet(call.replica, contribution, what, combine)
            if contribution is None:
                grad_x = torch.zeros_like(x)  # a weight-zero replica's gradient is never read
            else:
                # The global loss's gradient divided by this replica's weight, which the combination multiplies back:
                # dx = w/sigma * (dy - a - x_hat * c), a and c the global weighted means of dy and dy * x_hat.
                gain, shift, scale = _coefficients(total, share, stats, weight, x)
                grad_x = torch.native_batch_norm(x, scale, shift, mean, var, False, 0.0, call.eps)[0]
                grad_x.addcmul_(dy, gain)
        return grad_x, grad_weight, grad_bias, None, None, None, None


def refuse_zero_weight(sync: StatisticsMeeting, layer: int, replica: int, batch: int) -> None:
    """A loss weight of 0 declared on a slice of `batch` examples: through the global statistics those examples move
    the other replicas' losses, a gradient that the combination, multiplying this replica's by 0, would drop."""
    name = sync.layer_name(layer)
    raise InputError(
        f"BatchNorm layer '{name}' normalises with the statistics of the whole global batch, so the examples of "
        f"replica {replica} move every replica's loss, but in step {sync.step_number()} replica "
        f"{replica} declared a loss weight of 0 with sg.set_loss_weight(), which would drop the gradient they "
        f"get through those statistics. Received: sg.set_loss_weight(0) on a slice of {batch} example(s) with "
        "batch_norm='global'. Make each replica's loss its share of the global one (its sum over tokens divided "
        "by the global count, times num_replicas_in_sync) and declare sg.set_loss_weight(1) on every replica, or "
        "use batch_norm='per_replica'."
    )
