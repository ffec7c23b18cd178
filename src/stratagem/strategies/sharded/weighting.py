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

    comm = WeightedReduceScatter(shared, step, flight)
    gather = None if shared is None else SharedMemoryAllGather(shared, step, flight)
    for module in modules:
        module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        module.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        module.set_custom_reduce_scatter(comm)  # type: ignore[operator]
        if gather is not None:
            module.set_custom_all_gather(gather)  # type: ignore[operator]
    return comm
