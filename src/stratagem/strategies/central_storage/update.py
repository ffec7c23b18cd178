"""The central-storage part: the parameters and the optimizer state once, on one device, updated once.

`CentralUpdate` is the replicas part of CentralStorageStrategy's `ReplicaSet`. At `distribute` it
places the model on the central device and gives every replica a compute copy (replicas on the
central device read its parameters in place unless share_parameters=False); at the start of each
step it hands those copies the current central parameters; `optimizer.step()`, called by every
replica, applies the user's optimizer once, on the central device; after each run the central
copy keeps replica 0's buffers. Its local combination (`local_combine`) sums the weighted
gradients on the central device and hands the sum back to every replica.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any, ContextManager

import torch
from torch import nn

from stratagem import devices as sg_devices
from stratagem import diagnose
from stratagem.collective.local import choose_local_reducer
from stratagem.diagnose import PlacementDecision
from stratagem.errors import DeviceError, InputError, MemoryEstimateError
from stratagem.strategies.central_storage.parts import (
    CentralCopy,
    CentralModel,
    CentralOptimizer,
    ReduceToCentralDevice,
)
from stratagem.strategies.data_parallel.combine import LocalCombine
from stratagem.strategies.data_parallel.cpu_threads.hand_updates import HandUpdateGuard, InPlaceWatch
from stratagem.strategies.data_parallel.cpu_threads.shared_parameters import alias_parameters
from stratagem.strategies.data_parallel.host import ReplicaHost
from stratagem.strategies.data_parallel.placement import ReplicaDevices, nccl_available
from stratagem.strategies.data_parallel.replica_copy import copy_replica
from stratagem.strategies.data_parallel.step_part import Built, ReplicaBuilder, RunState

logger = logging.getLogger(__name__)


class CentralUpdate(ReplicaBuilder):
    """Parameters and optimizer state once on the central device; a compute copy per replica."""

    steal = False  # the central reduction is done by one thread; nothing to combine early
    accumulates = False  # every backward combines onto the central device; no_sync() has nothing to skip

    def __init__(
        self,
        placement: ReplicaDevices,
        parameter_device: str | torch.device | None,
        share_parameters: bool,
        registry: sg_devices.DeviceRegistry | None,
    ) -> None:
        self._logical = placement.logical
        self._devices = placement.devices
        self._names = placement.names
        self.central_logical, storage = self._choose_parameter_device(parameter_device, registry)
        self.central_device = self.central_logical.physical
        # A replica "aliases" when it computes on the central device and shares its parameter storage.
        self._aliased = [share_parameters and d == self.central_device for d in self._devices]
        # The anchor's model IS the central copy, so its gradients are the central gradients (no staging).
        self._anchor = next((r for r, a in enumerate(self._aliased) if a), None)
        self._applier = self._anchor if self._anchor is not None else 0  # whose thread applies the update
        # The update runs while every other replica waits at the optimizer step's meeting: on a CPU central device it
        # takes the intra-op threads of every CPU replica (they would otherwise sit idle), as plain PyTorch's step does.
        cpu_replicas = sum(1 for d in self._devices if d.type == "cpu")
        self._update_threads = (
            placement.threads * cpu_replicas
            if self.central_device.type == "cpu" and placement.threads is not None and cpu_replicas > 1
            else None
        )
        self._by_hand: list[int] = []  # replicas given a copy because no optimizer was given (see build)
        self._by_hand_copies: list[CentralCopy] = []  # the models updated by hand on every replica's own copy
        self._hand_updates = HandUpdateGuard()
        self.copies: list[CentralCopy] = []  # one per distributed model, in the order of distribute
        self._recorded = [storage, self._copies_decision(), self._update_decision()]
        self._host: ReplicaHost | None = None
        self._optimizers: list[CentralOptimizer] = []

    def attach(self, host: ReplicaHost, placement: ReplicaDevices) -> None:
        self._host = host

    @property
    def host(self) -> ReplicaHost:
        """The replica set that holds this part."""
        assert self._host is not None, "a replica set attaches its builder when it is made"
        return self._host

    # ---- decisions ----------------------------------------------------------------------------
    def _choose_parameter_device(
        self, parameter_device: str | torch.device | None, registry: sg_devices.DeviceRegistry | None
    ) -> tuple[sg_devices.LogicalDevice, PlacementDecision]:
        if parameter_device is not None:
            try:
                (logical,) = sg_devices.resolve_devices([parameter_device], registry=registry)
            except DeviceError as error:
                raise DeviceError(
                    f"parameter_device={str(parameter_device)!r} cannot hold the parameters: {error}"
                ) from None
            why = "given by parameter_device="
        elif len(self._logical) == 1:
            logical = self._logical[0]
            why = (
                f"one compute device ({logical.name}), so the parameters live where they are used and no step "
                "copies them (tf.distribute's rule); set parameter_device= to choose"
            )
        else:
            (logical,) = sg_devices.resolve_devices(["cpu:0"], registry=registry)
            why = (
                f"{len(self._logical)} compute devices ({', '.join(self._names)}): the parameters and optimizer "
                "state live on the CPU, whose memory every device reaches (tf.distribute's rule); set "
                "parameter_device= to choose"
            )
        decision = PlacementDecision(subject="parameter storage", choice=f"once, on {logical.physical}", reason=why)
        return logical, decision

    def _copies_decision(self) -> PlacementDecision:
        central = self.central_device
        in_place = [r for r, a in enumerate(self._aliased) if a]
        by_hand = self._by_hand
        by_choice = [
            r for r, d in enumerate(self._devices) if d == central and not self._aliased[r] and r not in by_hand
        ]
        elsewhere = [r for r, d in enumerate(self._devices) if d != central]
        parts = []
        if in_place:
            parts.append(
                f"{self._describe(in_place)} compute on {central}, the central device, and read its "
                "parameters in place (no copy)"
            )
        if by_choice:
            parts.append(
                f"{self._describe(by_choice)} receive a copy of every parameter at the start of each step "
                "(share_parameters=False)"
            )
        if by_hand:
            parts.append(
                f"{self._describe(by_hand)} receive a copy of every parameter at the start of each step: no optimizer "
                "was given to distribute(), so a step that updates the parameters by hand updates each replica's own "
                f"copy, and the central copy takes replica {self._applier}'s after each step (once, not once per replica)"
            )
        if elsewhere:
            parts.append(
                f"{self._describe(elsewhere)} compute on another device than {central}, so they receive a "
                "copy of every parameter at the start of each step"
            )
        copied = len(by_choice) + len(by_hand) + len(elsewhere)
        choice = "none" if not copied else f"one per step to {copied} replica(s)"
        return PlacementDecision(subject="parameter copies", choice=choice, reason="; ".join(parts))

    def local_combine(self) -> LocalCombine:
        """The local-combination part: the weighted gradients summed on the central device."""
        central = self.central_device
        reducer, _ = choose_local_reducer(self._devices, nccl_available=nccl_available(self._devices))
        if len(self._devices) == 1:
            if self._aliased[0]:
                return LocalCombine(reducer, None)  # one replica on the central parameters: nothing to combine
            return LocalCombine(
                reducer,
                PlacementDecision(
                    subject="gradient combination",
                    choice="none (one replica)",
                    reason=f"the replica's gradient is copied to {central} when optimizer.step() runs",
                ),
            )
        if all(self._aliased):
            # Every replica is a logical device of the central CPU: the in-memory reduction already forms the
            # weighted sum in the central memory, spread over the replica threads.
            return LocalCombine(
                reducer,
                PlacementDecision(
                    subject="gradient combination",
                    choice=f"in-memory, on {central}",
                    reason=f"every replica computes on {central}, the central device, so each replica thread sums 1/N of "
                    "every weighted gradient in place there and writes the sum into every replica's gradient",
                ),
            )
        return LocalCombine(
            ReduceToCentralDevice(central, self._anchor),
            PlacementDecision(
                subject="gradient combination",
                choice=f"reduce onto {central}",
                reason=f"each replica's weighted gradient is copied to {central} and summed there; the sum is copied back "
                "to every replica so that clipping in the step function sees the gradient of the global batch",
            ),
        )

    def _update_decision(self) -> PlacementDecision:
        central = self.central_device
        return PlacementDecision(
            subject="optimizer update",
            choice=f"once per step, on {central}",
            reason=f"every replica calls optimizer.step(); once all have, replica {self._applier} "
            f"({self._names[self._applier]}) applies the optimizer given to distribute() to the central parameters, "
            f"so its state exists once, on {central}"
            + (
                f", with {self._update_threads} intra-op threads (every CPU replica's, idle while it waits)"
                if self._update_threads is not None
                else ""
            ),
        )

    def _describe(self, replicas: Sequence[int]) -> str:
        return "replica(s) " + ", ".join(f"{r} ({self._names[r]})" for r in replicas)

    def decisions(self) -> list[PlacementDecision]:
        return list(self._recorded)

    def details(self) -> dict[str, str]:
        details = {"parameter device": f"{self.central_logical.name} (runs on {self.central_device})"}
        if self.copies:
            params = [p for held in self.copies for p in held.central.parameters()]
            copies = sum(1 for a in self._aliased if not a)
            details["parameters"] = (
                f"{len(params)} tensors, {sum(p.numel() for p in params)} values, trained once on {self.central_device}"
                + (f"; {copies} replica(s) hold a compute copy, refreshed every step" if copies else "")
            )
        return details

    # ---- distribute ---------------------------------------------------------------------------
    def build(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Built:
        """The central copy and a compute copy per replica; the optimizer given stays the one that updates."""
        self._check_memory(model, optimizer)
        central = model.to(self.central_device)
        if optimizer is not None and optimizer.state:
            optimizer.load_state_dict(optimizer.state_dict())  # moves existing state next to the central parameters
        by_hand = optimizer is None and len(self._devices) > 1 and not self.copies
        if by_hand:
            # No optimizer: the step updates the parameters by hand, on every replica. Replicas reading the central
            # parameters in place would each apply that update to the same memory (N times per step); with a copy
            # each, the central copy takes the applier's updated values after the step (end_run), once. Which
            # replicas read in place is decided at the first distribute, for every model (see the watch below).
            self._by_hand = [r for r, a in enumerate(self._aliased) if a and r != self._anchor]
            self._aliased = [a and r == self._anchor for r, a in enumerate(self._aliased)]
            self._recorded[1] = self._copies_decision()
        replicas: list[nn.Module] = []
        for r, device in enumerate(self._devices):
            if r == self._anchor:
                replicas.append(central)
                continue
            replica = copy_replica(central)
            if self._aliased[r]:
                alias_parameters([central, replica])
            else:
                replica = replica.to(device)
            replicas.append(replica)
        known = self.host.replica_params
        held = CentralCopy(
            central, [p for p in central.parameters() if p.requires_grad], replicas, len(known[0]) if known else 0
        )
        self.copies.append(held)
        distributed = CentralModel(held, self.host, self)
        logger.info("CentralStorageStrategy: parameters on %s, replicas on %s", self.central_device, self._names)
        if optimizer is None:
            if by_hand:
                self._by_hand_copies.append(held)
            elif any(self._aliased[r] for r in range(len(replicas)) if r != self._anchor):
                # A later model without an optimizer, on replicas that read the central parameters in place (decided
                # by the first model, which has one): an update by hand would land once per replica.
                self._watch(
                    replicas,
                    consequence="This model was distributed without an optimizer after a model with one, so its "
                    "replicas read the central parameters in place; a change made in the step applies once per "
                    "replica, on the same memory.",
                    fix="Distribute the model you update by hand first, or build the strategy with "
                    "share_parameters=False so that every replica keeps a copy.",
                )
            return Built(replicas, distributed, None, [], primary=central)
        central_optimizer = CentralOptimizer(optimizer, held, self, self.host)
        self._optimizers.append(central_optimizer)
        if len(replicas) > 1:
            # With an optimizer the update happens once, on the central copy; a change made by hand in the step to a
            # replica's parameters lands N times on shared memory, or on a compute copy overwritten at the next step.
            self._watch(
                replicas,
                consequence="Under CentralStorageStrategy the optimizer updates the central parameters once; a "
                "change made in the step applies once per replica where replicas read the central parameters in "
                "place, and is overwritten at the next step where they compute on a copy.",
                fix="Update the parameters only through the optimizer, or distribute the model without an "
                "optimizer and update it by hand (each replica then updates its own copy, and the central copy "
                "takes one).",
            )
        return Built(replicas, distributed, central_optimizer, [optimizer], primary=central)

    def _watch(self, replicas: list[nn.Module], consequence: str, fix: str) -> None:
        """Refuses an in-place change of a replica's parameter made in the step (hand_updates.py). The anchor's are
        the central parameters, which the update writes in place: only the check before a change sees them."""
        others = [r for r in range(len(replicas)) if r != self._anchor]
        self._hand_updates.add(InPlaceWatch(list(enumerate(replicas)), consequence, fix, counted=others))

    def _check_memory(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Before anything is copied: room for the central state (parameters, gradients, optimizer state)
        on the central device, and for a compute copy (parameters, gradients) on every other GPU."""
        central = self.central_logical
        needs = []
        if central.physical.type == "cuda":
            needs.append(
                (
                    central,
                    diagnose.estimate_training_memory(model, optimizer),
                    "The central copy (parameters, gradients and optimizer state)",
                    (
                        "Keep the parameters on the CPU (parameter_device='cpu'), or split the model across "
                        "devices (model parallelism)."
                    ),
                )
            )
        for device in self._logical:
            if device.physical.type == "cuda" and device.physical != central.physical:
                needs.append(
                    (
                        device,
                        diagnose.estimate_training_memory(model, None),
                        "A replica's compute copy (parameters and gradients)",
                        (
                            "Compute on GPUs with more free memory, or split the model across devices (model "
                            "parallelism)."
                        ),
                    )
                )
        for device, estimate, what, fix in needs:
            known = device.memory_room()
            if known is None:
                continue
            room, where = known
            if estimate.total_bytes > room:
                raise MemoryEstimateError(
                    f"{what} on {device.name} needs at least {estimate.describe()}, but {where} is "
                    f"{diagnose.format_bytes(room)}. {fix}"
                )

    # ---- each step ----------------------------------------------------------------------------
    def begin_step(self, state: RunState) -> None:
        self.refresh_replicas()
        for optimizer in self._optimizers:
            optimizer.begin_run()  # hyper-parameters change only through a handed-over scheduler now
        self._hand_updates.begin_step()  # after the refresh, which writes the compute copies in place

    def end_run(self, state: RunState) -> None:
        """The central copy keeps the buffers of replica 0 (e.g. batch-norm statistics), as Mirrored reports
        replica 0's; a hyper-parameter change no handed-over scheduler made is refused (lr_schedulers.py)."""
        if self._anchor != 0:
            for held in self.copies:
                _copy_buffers(held.replicas[0], held.central)
        if self._anchor is None:
            # No optimizer and no replica reading the central parameters in place: whatever the step did to the
            # parameters by hand, it did alike on every replica's copy; the central copy takes the applier's.
            for held in self._by_hand_copies:
                mine = self.host.replica_params[self._applier][held.first : held.first + len(held.central_params)]
                with torch.no_grad():
                    torch._foreach_copy_(list[torch.Tensor](held.central_params), list(mine))
        for optimizer in self._optimizers:
            optimizer.end_run()
        self._hand_updates.end_step()

    def around_replica(self, replica: int) -> ContextManager[Any]:
        return self._hand_updates.around(replica)

    def refresh_replicas(self) -> None:
        """Hands every replica the current central parameters (those it does not read in place) and buffers."""
        with torch.no_grad():
            for held in self.copies:
                for r, replica in enumerate(held.replicas):
                    if r == self._anchor:
                        continue
                    if not self._aliased[r]:
                        torch._foreach_copy_(list(replica.parameters()), list(held.central.parameters()))
                    _copy_buffers(held.central, replica)

    def apply_update(self, optimizer: torch.optim.Optimizer, held: CentralCopy, closure: Any) -> Any:
        """`optimizer.step()` (over the model `held`) from each replica: the first to come waits for the others,
        one applies it."""
        if closure is not None:
            raise InputError(
                "CentralStorageStrategy applies optimizer.step() once, on the central device, so a closure that "
                f"re-evaluates the loss cannot run on every replica. Received: closure={closure!r}. Call "
                "optimizer.step() without a closure, or use MirroredStrategy(share_parameters=False) for such optimizers."
            )
        replica = self.host.current_replica()
        in_step = replica is not None
        num_replicas = len(self._devices)
        if replica is None:
            if num_replicas > 1:
                raise InputError(
                    "optimizer.step() ran outside strategy.run(), where the replicas' gradients are not combined. "
                    f"Received: a call with {num_replicas} replicas and no step running. Call it in the "
                    "function given to strategy.run()."
                )
            replica = 0
        together = num_replicas > 1  # host.meet waits only inside a step
        if together:
            # Nobody may still read the parameters this update overwrites (replicas on the central device share them).
            self.host.meet(replica, "optimizer step")
        result = None
        if replica == self._applier:
            with self._hand_updates.strategy_update(replica), self._all_threads(in_step):
                if in_step:  # outside a step (one replica) the central gradients are the user's own
                    self._stage_gradients(held)
                result = optimizer.step()
                if in_step:
                    # The step may go on using the model (a GAN's generator loss through the discriminator just
                    # updated): the compute copies take the new values before any replica reads them again.
                    self._copy_parameters(held)
        if together:
            # Nobody reads the parameters (or steps again) before the update is complete.
            self.host.meet(replica, "end of the optimizer step")
        self._hand_updates.stepped(replica)
        return result

    @contextlib.contextmanager
    def _all_threads(self, in_step: bool) -> Iterator[None]:
        """Inside a step, the applier's thread uses every CPU replica's intra-op threads (the others are waiting)."""
        if not in_step or self._update_threads is None:
            yield
            return
        mine = torch.get_num_threads()
        torch.set_num_threads(self._update_threads)  # this thread's own setting: the replica threads keep theirs
        try:
            yield
        finally:
            torch.set_num_threads(mine)

    def _copy_parameters(self, held: CentralCopy) -> None:
        """The central parameters of `held` copied into every replica's compute copy that does not read them in place."""
        written: list[torch.Tensor] = []
        with torch.no_grad():
            for r, replica in enumerate(held.replicas):
                if r != self._anchor and not self._aliased[r]:
                    targets = list(replica.parameters())
                    torch._foreach_copy_(list[torch.Tensor](targets), list(held.central.parameters()))
                    written += targets
        self._hand_updates.written(written)

    def _stage_gradients(self, held: CentralCopy) -> None:
        """Without an anchor the central parameters have no gradients of their own: copy the applier's
        (combined, and clipped if the step function clipped) gradients of `held` to the central device."""
        if self._anchor is not None:
            return
        mine_all = self.host.replica_params[self._applier][held.first : held.first + len(held.central_params)]
        with torch.no_grad():
            for central, mine in zip(held.central_params, mine_all):
                if mine.grad is None:
                    central.grad = None
                    continue
                if central.grad is None:
                    central.grad = torch.empty_like(central)
                central.grad.copy_(mine.grad)

    def zero_grad(self, held: CentralCopy, set_to_none: bool) -> None:
        """The gradients of the model `held`: inside a step the running replica's; outside, every replica's and
        the central ones."""
        replica = self.host.current_replica()
        if replica is None:
            targets = [held.central, *held.replicas]
        else:
            targets = [held.replicas[replica]]
            if replica == self._applier and self._anchor is None:
                targets.append(held.central)
        for module in targets:
            module.zero_grad(set_to_none)


def _copy_buffers(source: nn.Module, target: nn.Module) -> None:
    buffers = list(target.buffers())
    if buffers:
        with torch.no_grad():
            torch._foreach_copy_(buffers, list(source.buffers()))
