"""The replicas of Mirrored, OneDevice and MultiWorkerMirrored: a copy of the model per device, and the
optimizer that updates them all (`MirroredReplicas`, the part the replica set builds them with).

Replica 0 is the model itself, moved to the first device; every other replica is a deep copy on its
own device. Replicas that share one copy of the parameters (logical devices of one CPU, see
strategies/data_parallel/cpu_threads/shared_parameters.py) get a `ShardedOptimizer`, each replica updating 1/N of the parameters;
otherwise each replica gets its own copy of the optimizer (`DistributedOptimizer`), with the state
the user's optimizer already had.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ContextManager

import torch
from torch import nn

from stratagem.diagnose import PlacementDecision
from stratagem.strategies.data_parallel import cuda_numerics, placement
from stratagem.strategies.data_parallel.compiled import make_room_for_replicas
from stratagem.strategies.data_parallel.cpu_threads.hand_updates import HandUpdateGuard, InPlaceWatch
from stratagem.strategies.data_parallel.cpu_threads.shared_parameters import ShardedOptimizer, alias_parameters
from stratagem.strategies.data_parallel.distributed import DistributedModel, DistributedOptimizer, replicate_optimizer
from stratagem.strategies.data_parallel.host import ReplicaHost
from stratagem.strategies.data_parallel.placement import ReplicaDevices
from stratagem.strategies.data_parallel.replica_copy import copy_replica
from stratagem.strategies.data_parallel.step_part import Built, ReplicaBuilder, RunState


def make_replicas(model: nn.Module, devices: Sequence[torch.device], shared: bool) -> list[nn.Module]:
    """One replica per device, replica 0 being `model`; with `shared`, all read replica 0's parameters."""
    replicas = [model.to(devices[0])]
    for device in devices[1:]:
        replicas.append(copy_replica(model).to(device))
    if shared:
        alias_parameters(replicas)
    return replicas


def distribute_optimizer(
    optimizer: torch.optim.Optimizer,
    source_params: list[nn.Parameter],
    replicas: list[nn.Module],
    first_device: torch.device,
    shared: bool,
    host: ReplicaHost,
) -> ShardedOptimizer | DistributedOptimizer | None:
    """The optimizer `distribute` returns (None with one private replica: the user's own)."""
    if optimizer.state and first_device.type != "cpu":
        optimizer.load_state_dict(optimizer.state_dict())  # moves existing state next to the parameters
    distributed: ShardedOptimizer | DistributedOptimizer | None = None
    if shared:
        distributed = ShardedOptimizer(optimizer, [list(r.parameters()) for r in replicas], host)
    elif len(replicas) > 1:
        distributed = DistributedOptimizer(
            [optimizer] + [replicate_optimizer(optimizer, source_params, list(r.parameters())) for r in replicas[1:]],
            host,
        )
    return distributed


class MirroredReplicas(ReplicaBuilder):
    """The replicas part of Mirrored, OneDevice and MultiWorkerMirrored: at `distribute`, a copy of the model
    per device (one copy read by all, on logical devices of one CPU, when the optimizer allows it), and the
    optimizer that updates them all. It records the decisions it makes then: room in torch.compile's cache,
    each GPU replica's random stream, and where the parameters live ("parameter storage")."""

    steal = True  # replicas waiting at the end of backward may combine the others' gradients early
    accumulates = True  # no_sync() skips the combination of a backward pass

    def __init__(self, share_parameters: bool | None, first_global_replica: int = 0) -> None:
        self._share_parameters = share_parameters
        self.first_global_replica = first_global_replica  # seeds each replica's random stream
        self._recorded: list[PlacementDecision] = []
        self._host: ReplicaHost | None = None
        self._placement: ReplicaDevices | None = None
        self._optimizers: list[ShardedOptimizer | DistributedOptimizer] = []  # one per distributed model with one
        self._seeded = False  # each GPU replica's random stream, seeded at the first distribute
        self._hand_updates = HandUpdateGuard()

    def attach(self, host: ReplicaHost, placement: ReplicaDevices) -> None:
        self._host = host
        self._placement = placement

    def build(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Built:
        host, where = self._host, self._placement
        assert host is not None and where is not None, "a replica set attaches its builder when it is made"
        devices = where.devices
        placement.check_memory(where.logical, model, optimizer)  # before anything is copied
        self._record(make_room_for_replicas(model, len(devices)))
        if not self._seeded:
            # Once, at the first model: a later model's distribute must not restart the replicas' streams.
            self._seeded = True
            self._record(cuda_numerics.seed_replica_streams(devices, self.first_global_replica))
        source_params = list(model.parameters())
        shared, decision = placement.decide_sharing(devices, self._share_parameters, model, optimizer)
        self._record(decision)
        replicas = make_replicas(model, devices, shared)
        distributed = None
        if optimizer is not None:
            distributed = distribute_optimizer(optimizer, source_params, replicas, devices[0], shared, host)
        plain = distributed.replica_optimizers if distributed is not None else []
        if optimizer is not None and not plain:
            plain = [optimizer]
        if distributed is not None:
            self._optimizers.append(distributed)
        if shared:
            # Shared parameters are chosen only with an optimizer (placement.decide_sharing); a hand-written update
            # in the step on top of it would run on every replica, on the same memory.
            n = len(replicas)
            self._hand_updates.add(
                InPlaceWatch(
                    list(enumerate(replicas)),
                    consequence=f"The {n} replicas share one copy of the parameters, so every replica's change lands "
                    f"on the same memory: applied {n} times per step, the parameters would no longer be one "
                    "device's.",
                    fix="Update the parameters only through the optimizer, or keep a copy per replica with "
                    "MirroredStrategy(share_parameters=False), where each replica applies the combined gradient to its "
                    "own copy (once per step).",
                )
            )
            for r, shard_optimizer in enumerate(plain):
                # Its writes go through views taken with `.data`, which the check does not see: noted for the error.
                shard_optimizer.register_step_post_hook(lambda *_, r=r: self._hand_updates.stepped(r))
        # A DistributedModel with one replica too: `.module` is the plain model under every replica count.
        model_out = DistributedModel(replicas, host)
        if len(replicas) == 1:
            return Built(replicas, model_out, optimizer, plain)
        return Built(replicas, model_out, distributed, plain)

    def _record(self, decision: PlacementDecision | None) -> None:
        if decision is not None and decision not in self._recorded:  # a second model decided alike says nothing new
            self._recorded.append(decision)

    def begin_step(self, state: RunState) -> None:
        """Nothing to hand out (every replica keeps its own parameters, updated alike); from here the
        hyper-parameters change only through a scheduler handed to the strategy (lr_schedulers.py)."""
        for optimizer in self._optimizers:
            optimizer.begin_run()
        self._hand_updates.begin_step()

    def end_run(self, state: RunState) -> None:
        """Refuses a hyper-parameter change inside the run that no handed-over scheduler made."""
        for optimizer in self._optimizers:
            optimizer.end_run()
        self._hand_updates.end_step()

    def around_replica(self, replica: int) -> ContextManager[Any]:
        return self._hand_updates.around(replica)

    def decisions(self) -> list[PlacementDecision]:
        return list(self._recorded)

    def details(self) -> dict[str, str]:
        return {}
