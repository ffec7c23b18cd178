"""MirroredStrategy's replicas: a copy of the model per device, and the optimizer that updates them all.

Replica 0 is the model itself, moved to the first device; every other replica is a deep copy on its
own device. Replicas that share one copy of the parameters (logical devices of one CPU, see
strategies/sharded.py) get a `ShardedOptimizer`, each replica updating 1/N of the parameters;
otherwise each replica gets its own copy of the optimizer (`DistributedOptimizer`), with the state
the user's optimizer already had.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from stratagem.strategies import lr_schedulers
from stratagem.strategies.distributed import DistributedOptimizer, replicate_optimizer
from stratagem.strategies.sharded import ShardedOptimizer, alias_parameters


def make_replicas(model: nn.Module, devices: Sequence[torch.device], shared: bool) -> list[nn.Module]:
    """One replica per device, replica 0 being `model`; with `shared`, all read replica 0's parameters."""
    replicas = [model.to(devices[0])]
    for device in devices[1:]:
        replicas.append(copy.deepcopy(model).to(device))
    if shared:
        alias_parameters(replicas)
    return replicas


def distribute_optimizer(
    optimizer: torch.optim.Optimizer,
    source_params: list[nn.Parameter],
    replicas: list[nn.Module],
    first_device: torch.device,
    shared: bool,
    strategy: Any,
) -> ShardedOptimizer | DistributedOptimizer | None:
    """The optimizer `distribute` returns (None with one private replica: the user's own)."""
    if optimizer.state and first_device.type != "cpu":
        optimizer.load_state_dict(optimizer.state_dict())  # moves existing state next to the parameters
    distributed: ShardedOptimizer | DistributedOptimizer | None = None
    if shared:
        distributed = ShardedOptimizer(optimizer, [list(r.parameters()) for r in replicas], strategy)
    elif len(replicas) > 1:
        distributed = DistributedOptimizer(
            [optimizer] + [replicate_optimizer(optimizer, source_params, list(r.parameters())) for r in replicas[1:]],
            strategy,
        )
    if distributed is not None:  # schedulers built before distribute step once per step too
        lr_schedulers.adopt_existing(optimizer, distributed, gc.get_referrers)
    return distributed
