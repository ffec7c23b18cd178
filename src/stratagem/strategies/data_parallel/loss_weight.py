"""Losses weighted by what they average over (tokens, not examples).

By default each replica's gradient is weighted by its share of the global batch's EXAMPLES, which
gives one device's update for a loss that is a mean over examples. A loss that is a mean over
something else, such as the non-padding tokens of a language-model batch (Hugging Face's labels of
-100 are left out of its mean), needs each replica weighted by ITS count of those units instead:
one device's gradient of the mean over all N tokens is sum_r (n_r / N) * grad(mean over replica r's
n_r tokens). `set_loss_weight(n_r)`, called in the step function before `backward()`, declares n_r;
the strategy then combines the gradients as sum_r n_r g_r / sum_r n_r across every replica and
worker, and `strategy.reduce("mean", losses)` weights the losses by the same counts.

Example:
    >>> def step(batch):
    ...     out = model(**batch)                                   # out.loss: mean over non-padding tokens
    ...     sg.set_loss_weight((batch["labels"][:, 1:] != -100).sum())
    ...     out.loss.backward()                                    # combined by token counts
    ...     optimizer.step(); optimizer.zero_grad()
    ...     return out.loss
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from stratagem.errors import InputError
from stratagem.strategies.replica_context import current_replica_context

if TYPE_CHECKING:
    from stratagem.strategies.data_parallel.step_part import RunState


def set_loss_weight(count: int | float | torch.Tensor) -> None:
    """Declares how many units this replica's loss averages over in this step (its weight in the
    combined gradient and in `reduce("mean", ...)`); call it inside the step function, before `backward()`,
    on every replica (a replica with nothing to average over declares 0).

    Named for what it changes, the weight of this replica's loss, rather than for the unit (tokens,
    pixels, examples): the strategy only needs the number.
    """
    ctx = current_replica_context()
    if ctx is None or ctx.strategy is None:
        raise InputError(
            "set_loss_weight() declares the weight of one replica's loss, so it runs inside the function given to "
            f"strategy.run(). Received: a call outside strategy.run() (count={_show(count)}). Call it in the step "
            "function, before loss.backward(). (A ParameterServerStrategy closure applies each worker's gradient "
            "on its own, so there it has nothing to weigh: leave it out there.)"
        )
    value = float(count.detach().sum()) if isinstance(count, torch.Tensor) else count
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InputError(
            "A loss weight is the number of units the replica's loss averages over: a finite number, 0 or more. "
            f"Received: count={_show(count)}. Pass e.g. (labels != -100).sum()."
        )
    if ctx.host is not None:  # nothing to weigh where one replica computes each update's gradient alone
        ctx.host.declare_loss_weight(ctx.replica_id_in_sync_group, float(value))


def _show(count: object) -> str:
    if isinstance(count, torch.Tensor):
        return f"a tensor of shape {tuple(count.shape)}" if count.numel() != 1 else f"tensor({count.item()!r})"
    return repr(count)


# ---- what the strategies do with the declared counts ---------------------------------------------
# A replica that declares count c_r has its gradient weighted by c_r itself (instead of its share of
# the examples) in the usual combination; once the weighted sum is complete, every replica divides it
# by the total count C = sum_r c_r (known locally, or summed along with the gradients across workers).


def declare(state: RunState, replica: int, count: float, num_local: int) -> None:
    """Records replica `replica`'s count in the step's state, and makes it that replica's weight."""
    if state.counts is None:
        state.counts = [None] * num_local
    state.counts[replica] = count
    state.weights[replica] = count


def local_total(counts: Sequence[float | None] | None) -> tuple[float, int]:
    """(sum of the declared counts, how many replicas declared one) among this process's replicas."""
    if counts is None:
        return 0.0, 0
    declared = [c for c in counts if c is not None]
    return float(sum(declared)), len(declared)


def check_total(total: float, num_declared: int, num_replicas: int, step: int) -> float | None:
    """The total count to divide by, None when no replica declared one (weighting by examples)."""
    if num_declared == 0:
        return None
    if num_declared != num_replicas:
        raise InputError(
            f"In step {step}, {num_declared} of {num_replicas} replicas declared a loss weight with "
            "sg.set_loss_weight() and the others did not, so their gradients cannot be combined in one unit. "
            "Call it on every replica (0 where a replica has nothing to average over), or on none."
        )
    return total


def divide_gradients_(params: Sequence[torch.nn.Parameter], total: float) -> None:
    """sum_r c_r g_r -> sum_r c_r g_r / C on one replica (left at zeros when nothing was counted anywhere)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads and total > 0:
        torch._foreach_div_(grads, total)
