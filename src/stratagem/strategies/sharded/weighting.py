"""Exact gradients: each rank's gradient weighted by its share of the global batch before the sum.

FSDP2 reduce-scatters gradients with `ReduceOp.AVG`, the mean of the per-rank gradients. Each rank's
gradient is that of the mean loss over ITS slice, so the mean over ranks is one device's gradient only
when every slice is the same size: 13 examples over 2 ranks (7 and 6) come out 7.7% off. One device's
gradient of the mean over the global batch of N examples is sum_r (n_r / N) g_r, a weighted SUM.

FSDP2's own hook for another divisor (`set_gradient_divide_factor`) multiplies before the sum with
`ReduceOp.PREMUL_SUM`, which Gloo does not have ("Cannot use ReduceOp.PREMUL_SUM with Gloo"), and one
divisor cannot weight ranks differently anyway. So every unit is set to reduce with a plain SUM and a
divide factor of 1 (`set_force_sum_reduction_for_comms`, `set_gradient_divide_factor(1.0)`), and its
reduce-scatter (`set_custom_reduce_scatter`) first multiplies this rank's flat gradient buffer, FSDP's
own copy, by the rank's weight n_r / N: the sum that comes out is one device's gradient, on Gloo and
NCCL alike. A declared `sg.set_loss_weight(c_r)` makes the weight c_r / sum_r c_r instead.

Pre-scaling rather than dividing the sum afterwards keeps each rank's term as one device would weigh it;
the weight of a rank is the same for every unit of one backward, so the scaled buffers need no care
about which unit runs when.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from stratagem.collective.flight import FlightRecord
    from stratagem.shm.sums import SharedMemoryGroup
    from stratagem.strategies.sharded.reduce_scatter import WeightedReduceScatter


def weigh_gradients(
    modules: Sequence[nn.Module],
    shared: SharedMemoryGroup | None = None,
    step: Callable[[], int] = lambda: 0,
    flight: FlightRecord | None = None,
) -> WeightedReduceScatter:
    """Makes every sharded module of the model reduce with a weighted SUM; returns the comm whose weight `run` sets.

    With `shared` (every worker on this host: transport.py) both of a unit's collectives go through shared memory;
    `step` numbers the step in their errors; `flight` keeps them in the worker's record of its last collectives."""
    from stratagem.strategies.sharded.reduce_scatter import (  # imports FSDP: see its module
        SharedMemoryAllGather,
        WeightedReduceScatter,
    )

    comm = WeightedReduceScatter(shared, step, flight, no_gradient_read_in_backward(modules))
    gather = None if shared is None else SharedMemoryAllGather(shared, step, flight)
    for module in modules:
        module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        module.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        module.set_custom_reduce_scatter(comm)  # type: ignore[operator]
        if gather is not None:
            module.set_custom_all_gather(gather)  # type: ignore[operator]
    return comm


def no_gradient_read_in_backward(modules: Sequence[nn.Module]) -> Callable[[], bool]:
    """For `WeightedReduceScatter.may_defer`: whether none of the sharded parameters of `modules` (as they are now,
    sharded) has a gradient or a hook run after its gradient is accumulated. FSDP2 reads a unit's reduce-scatter
    output at once only in those cases (it adds into an existing gradient; the hook reads it), so a backward that
    starts with neither may let each reduce-scatter end later in it. Weak references: the strategy does not keep a
    model the user dropped."""
    seen: dict[int, weakref.ref[nn.Parameter]] = {}
    for module in modules:
        for parameter in module.parameters():
            seen.setdefault(id(parameter), weakref.ref(parameter))
    parameters = list(seen.values())

    def may_defer() -> bool:
        for ref in parameters:
            parameter = ref()
            if parameter is not None and (parameter.grad is not None or parameter._post_accumulate_grad_hooks):
                return False
        return True

    return may_defer
