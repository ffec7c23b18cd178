"""The autograd function of a BatchNorm layer whose statistics are those of the global batch, and the sums
the replicas' contributions are combined with (batch_norm.py holds the layers and the meetings).

Each training call meets the other replicas once in forward and once in backward. A replica brings only
what its own slice gives (its mean and biased variance, or its two backward sums, in the input's dtype);
the last replica to arrive at the meeting combines every contribution once, in replica order and in
float64, sums across workers when there are several, and derives everything per channel that any replica
then uses (the global mean and variance in the statistics' dtype, the running-statistics targets, and in
backward each replica's gain, shift and scale). The others wake to a finished result.

What a meeting costs is mostly time on the critical path of every replica: the others wait while the last
one combines, so the combination is a handful of array operations. On the CPU they run in numpy: there a
small torch operation costs about 1 us of dispatch and gives up Python's global lock, which the other replica
thread, returning from a kernel, then takes, so every small torch call between two replica threads costs a
lock hand-over (measured: a 64-element `torch.add` took 1.0 us alone and 1.7 us beside a thread running
convolutions). Elsewhere (GPUs) the same arithmetic runs in torch on the combining device, without a copy to
the host that would make each replica's stream wait at every layer.
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

_BATCH_NORM_BACKWARD = torch.ops.aten.native_batch_norm_backward.default  # the overload itself: no lookup per call


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


# ---- arrays of per-channel values: numpy on the CPU, torch elsewhere -------------------------------------
Array = Any  # np.ndarray or torch.Tensor, both float64: the arithmetic below is written for either

_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


def _host(device: torch.device) -> bool:
    """Whether the meeting's arithmetic runs in numpy (the combining replica's tensors are in host memory)."""
    return device.type == "cpu"


def _rows64(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> Array:
    """Per-channel vectors of one replica as the rows of one float64 array, made by that replica before it
    arrives at a meeting (so the one who combines only stacks them): numpy for host memory."""
    rows = torch.stack(tensors).to(torch.float64)
    return rows.numpy() if _host(rows.device) else rows


def _stack(arrays: Sequence[Array], device: torch.device) -> Array:
    """Every present replica's rows, stacked on the combining device: (replicas, rows, channels)."""
    if _host(device):
        return np.stack([a if isinstance(a, np.ndarray) else _numpy(a) for a in arrays])
    return torch.stack([_array_on(a, device) for a in arrays])


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return (t.float() if t.dtype not in _NUMPY_DTYPES else t).numpy()


def _vector(values: Sequence[float], device: torch.device) -> Array:
    if _host(device):
        return np.array(values, dtype=np.float64)
    return torch.tensor(values, dtype=torch.float64, device=device)


def _zeros(size: int, device: torch.device) -> tuple[Array, torch.Tensor]:
    """A float64 vector of zeros as an array, and as a tensor sharing its memory (for the sum across workers)."""
    if _host(device):
        array = np.zeros(size, dtype=np.float64)
        return array, torch.from_numpy(array)
    tensor = torch.zeros(size, dtype=torch.float64, device=device)
    return tensor, tensor


def _tensor(array: Array, dtype: torch.dtype) -> torch.Tensor:
    """A float64 array as a tensor of `dtype` (on the array's device)."""
    if isinstance(array, np.ndarray):
        target = _NUMPY_DTYPES.get(dtype, np.float32)
        tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=target))
        return tensor if tensor.dtype == dtype else tensor.to(dtype)
    return array.to(dtype)


def _array_on(array: Array, device: torch.device) -> Array:
    """A float64 array of another meeting (the forward's, combined by another replica) on this one's `device`."""
    if isinstance(array, np.ndarray):
        return array if _host(device) else torch.from_numpy(array).to(device)
    return _numpy(array) if _host(device) else array.to(device)


def _concat(first: Array, second: Array) -> Array:
    return np.concatenate((first, second)) if isinstance(first, np.ndarray) else torch.cat((first, second))


def _sqrt(array: Array) -> Array:
    return np.sqrt(array) if isinstance(array, np.ndarray) else torch.sqrt(array)


def _clamp_(array: Array) -> None:
    if isinstance(array, np.ndarray):
        np.maximum(array, 0.0, out=array)
    else:
        array.clamp_(min=0)


# ---- forward -----------------------------------------------------------------------------------------
@dataclass
class ForwardShare:
    """One replica's contribution to a forward meeting: its values per channel, and their mean and biased
    variance (a stable mean and variance keep the float32 case well conditioned)."""

    count: int
    stats: Array  # [mean, biased variance] in float64, (2, channels)


@dataclass
class ForwardStatistics:
    """What every replica normalises with, computed once per meeting."""

    mean: torch.Tensor  # in the statistics' dtype
    var: torch.Tensor  # biased, in the statistics' dtype
    invstd: Array  # 1 / sqrt(var + eps) in float64 (the backward's gain)
    running_mean: torch.Tensor | None  # the global mean, in the running buffers' dtype (None: no buffers)
    running_var: torch.Tensor | None  # the unbiased global variance, in the running buffers' dtype
    size: float  # values per channel over the global batch


def _sum_forward(present: Sequence[ForwardShare], channels: int, device: torch.device) -> tuple[Array, torch.Tensor]:
    """[sum, sum of squares, count] per channel over the contributions, in float64 and replica order: as an
    array, and as a tensor sharing its memory."""
    total, tensor = _zeros(2 * channels + 1, device)
    if present:
        counts = _vector([float(c.count) for c in present], device)
        stats = _stack([c.stats for c in present], device)  # (replicas, 2, channels)
        means = stats[:, 0]
        stats[:, 1] += means * means  # var + mean^2: the mean of the squares
        total[: 2 * channels] = counts @ stats.reshape(len(present), 2 * channels)
        total[-1] = counts.sum()
    return total, tensor


def _forward_statistics(
    total: Array,
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
    moments = total[: 2 * channels].reshape(2, channels) / size  # [mean, mean of the squares]
    mean64, var64 = moments[0], moments[1]
    var64 -= mean64 * mean64
    _clamp_(var64)
    invstd = 1.0 / _sqrt(var64 + eps)
    if running_dtype is None:
        mean, var = _tensor(moments, stats_dtype).unbind(0)
        return ForwardStatistics(mean, var, invstd, None, None, size)
    unbiased = var64 * (size / (size - 1))
    if running_dtype == stats_dtype:  # one conversion for the three
        mean, var, running_var = _tensor(_concat(moments, unbiased.reshape(1, channels)), stats_dtype).unbind(0)
        return ForwardStatistics(mean, var, invstd, mean, running_var, size)
    mean, var = _tensor(moments, stats_dtype).unbind(0)
    running = _tensor(_concat(mean64.reshape(1, channels), unbiased.reshape(1, channels)), running_dtype)
    return ForwardStatistics(mean, var, invstd, running[0], running[1], size)


def _on(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`tensor` on `like`'s device (the meeting combines on the last arrival's device)."""
    return tensor if tensor.device == like.device else tensor.to(like.device)


class GlobalBatchNormFunction(torch.autograd.Function):
    """Batch normalisation with statistics summed over every replica (see the module docstring).

    The element-wise passes are torch's own fused kernels, as many as plain training BatchNorm takes: the
    local mean and variance from `batch_norm_update_stats` and the output from eval-mode `native_batch_norm`
    given the global mean and variance (plain BatchNorm's training kernel does the same two passes); the local
    sums of the backward pass from eval-mode `native_batch_norm_backward` (which then skips the input gradient),
    and the input gradient from one more eval-mode `native_batch_norm` of the input plus `dy` scaled (torch's
    one-pass `batch_norm_backward_elemt` has no CPU kernel). Everything per channel is computed once per
    meeting for all replicas, by the last to arrive: a replica itself runs only those kernels, two `lerp_`s
    of its running statistics, and the meetings.
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
            mean_var = torch.batch_norm_update_stats(x, None, None, 0.0)  # biased variance
            contribution = ForwardShare(x.numel() // channels, _rows64(mean_var))
        # Under autocast the input may be bfloat16 while the parameters stay float32: torch's kernels then take
        # statistics of the parameters' dtype.
        stats_dtype = weight.dtype if weight is not None else x.dtype
        tracked = running_mean is not None and running_var is not None
        running_dtype = running_mean.dtype if running_mean is not None and tracked else None
        name = sync.layer_name(call.layer)
        what = f"BatchNorm statistics of '{name}' (forward)"

        def combine(contributions: Sequence[ForwardShare | None], step: int) -> ForwardStatistics:
            total, tensor = _sum_forward([c for c in contributions if c is not None], channels, x.device)
            sync.sum_across_workers(tensor, what, step)
            where = f"BatchNorm layer '{name}' (input of shape {tuple(x.shape)} on replica {call.replica})"
            return _forward_statistics(total, channels, stats_dtype, running_dtype, call.eps, where)

        stats: ForwardStatistics = sync.meet(call.replica, contribution, what, combine)
        if running_mean is not None and running_var is not None:
            if stats.running_mean is not None and stats.running_var is not None:  # set whenever the buffers were passed
                targets = [_on(stats.running_mean, running_mean), _on(stats.running_var, running_var)]
                torch._foreach_lerp_([running_mean, running_var], targets, factor)
        mean, var = _on(stats.mean, x), _on(stats.var, x)
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
        _, sum_dy_xhat, sum_dy = _BATCH_NORM_BACKWARD(
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
            contribution = None
            if not idle:
                contribution = BackwardShare(share, _rows64([sum_dy, sum_dy_xhat]), weight, x.dim())
            what = f"BatchNorm statistics of '{sync.layer_name(call.layer)}' (backward)"
            channels, device, dtype = x.shape[1], x.device, mean.dtype

            def combine(contributions: Sequence[BackwardShare | None], step: int) -> None:
                present = [c for c in contributions if c is not None]
                _combine_backward(present, channels, stats, device, dtype, what, step, sync)

            sync.meet(call.replica, contribution, what, combine)
            if contribution is None:
                grad_x = torch.zeros_like(x)  # a weight-zero replica's gradient is never read
            else:
                # The global loss's gradient divided by this replica's weight, which the combination multiplies back:
                # dx = w/sigma * (dy - a - x_hat * c), a and c the global weighted means of dy and dy * x_hat: an
                # eval-mode normalisation of x with weight -w/sigma*c and bias -w/sigma*a, plus dy * w/sigma.
                gain, shift, scale = (_on(t, x) for t in contribution.result)
                grad_x = torch.native_batch_norm(x, scale, shift, mean, var, False, 0.0, call.eps)[0]
                grad_x.addcmul_(dy, gain)
        return grad_x, grad_weight, grad_bias, None, None, None, None


# ---- backward ----------------------------------------------------------------------------------------
@dataclass
class BackwardShare:
    """One replica's contribution to a backward meeting, and what the meeting hands back to it."""

    share: float  # its combination weight
    sums: Array  # [sum dy, sum dy * x_hat] in float64, (2, channels)
    weight: torch.Tensor | None  # the layer's weight on this replica
    dims: int  # of the input, for the gain's shape
    result: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = ()  # type: ignore[assignment]
    """Set by the meeting, in the statistics' dtype: w/sigma shaped to multiply dy, and -(w/sigma)*(a, c) over
    this replica's share."""


def _combine_backward(
    present: list[BackwardShare],
    channels: int,
    stats: ForwardStatistics,
    device: torch.device,
    dtype: torch.dtype,
    what: str,
    step: int,
    sync: StatisticsMeeting,
) -> None:
    """[sum dy, sum dy * x_hat] weighted by each replica's share of the global batch, in float64 and replica order,
    summed across workers; then, for every present replica at once, its gain w/sigma and the coefficients of its
    input gradient, -(w/sigma) * (a, c) / share."""
    total, tensor = _zeros(2 * channels, device)
    if present:
        shares = _vector([c.share for c in present], device)
        total[:] = shares @ _stack([c.sums for c in present], device).reshape(len(present), 2 * channels)
    sync.sum_across_workers(tensor, what, step)
    if not present:
        return
    # w/sigma from the first present replica's weight: every replica holds the same values (a change to one replica's
    # alone is refused, see hand_updates.py), so one gain serves all of them, on each replica's device.
    gains = _array_on(stats.invstd, device)
    weight = present[0].weight
    if weight is not None:
        gains = gains * _rows64([weight.detach() if weight.device == device else weight.detach().to(device)])[0]
    block = total.reshape(1, 2, channels) / (shares.reshape(-1, 1, 1) * -stats.size) * gains  # -(w/sigma)(a, c)/share
    gain = _tensor(gains.reshape((channels,) + (1,) * (present[0].dims - 2)), dtype)  # shaped to multiply dy
    for c, shift_scale in zip(present, _tensor(block, dtype).unbind(0)):
        shift, scale = shift_scale.unbind(0)
        c.result = (gain, shift, scale)


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
