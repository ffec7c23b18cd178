"""The sharded optimizer's implementation: torch's foreach kernels where the user left the choice to torch.

A torch optimizer given `foreach=None` picks its implementation by device: foreach (one operation over the list
of every parameter) on GPUs, a loop over the parameters on the CPU, where foreach kernels are loops too. Over
FSDP2's shards every operation of that loop is a DTensor operation, each dispatched on its own: AdamW on a tiny
GPT-2's 50 shards took 8 ms of CPU per step against 3 ms on plain tensors, and with `foreach=True` 3.5-4 ms
(benchmarks/reports/2026-12-07-cpu-2vcpu-sharded-speed.md). So the optimizer the strategy rebuilds over the shards
takes `foreach=True` where the user passed None, as torch itself does for DTensors on a GPU.

Only for the optimizers whose foreach step over DTensor shards equals their loop over plain tensors bit for bit
(measured in float32 and float64, `tests/test_sharded_units.py`): NAdam and ASGD round differently, and Rprop's
foreach step needs an operation DTensor does not shard (`aten._foreach_copy_`), so those keep torch's choice, as
does an optimizer class of the user's own (its step may not be torch's).
"""

from __future__ import annotations

import torch

FOREACH_EXACT: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.RAdam,
    torch.optim.Adadelta,
)
"""The optimizer classes whose foreach step over DTensor shards is their loop's, bit for bit."""


def prefer_foreach(optimizer: torch.optim.Optimizer) -> bool:
    """Sets `foreach=True` in each param group of `optimizer` (the strategy's copy over the shards) that left it to
    torch (None) and asked for no fused or differentiable step; True when any group changed."""
    if type(optimizer) not in FOREACH_EXACT:
        return False
    changed = False
    for group in optimizer.param_groups:
        if (
            "foreach" in group
            and group["foreach"] is None
            and not group.get("fused")
            and not group.get("differentiable")
        ):
            group["foreach"] = True
            changed = True
    return changed
