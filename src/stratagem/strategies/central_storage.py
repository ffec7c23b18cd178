"""CentralStorageStrategy: the parameters and the optimizer state live once, on one device, while
every local device computes (tf.distribute.experimental.CentralStorageStrategy).

Each step:

1. every replica that does not read the central parameters in place receives a copy of them (on
   GPUs that copy is the strategy's cost, paid every step; replicas on the central device share
   its storage and pay nothing);
2. each replica runs the step function on its slice of the global batch, on its own device;
3. when `backward()` finishes, the replicas' gradients, each weighted by the replica's share of the
   global batch, are summed on the central device and the sum is handed back to every replica, so
   clipping and gradient logging in the step function see the gradient of the whole global batch;
4. `optimizer.step()`, called by every replica, applies the user's own optimizer once, on the
   central device, after every replica has reached it; its state therefore exists once.

The gradient weighting, the replica threads and the barriers are MirroredStrategy's.
"""

from __future__ import annotations

import copy
import gc
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from stratagem import devices as sg_devices
from stratagem import diagnose, environ
from stratagem.diagnose import PlacementDecision
from stratagem.errors import (
    DeviceError,
    GpuUnavailableError,
    InputError,
    MemoryEstimateError,
)
from stratagem.strategies import lr_schedulers
from stratagem.strategies.base import Strategy
from stratagem.strategies.central_parts import (
    CentralModel,
    CentralOptimizer,
    ReduceToCentralDevice,
)
from stratagem.strategies.distributed import check_optimizer_supported
from stratagem.strategies.explain import Explanation
from stratagem.strategies.mirrored import MirroredStrategy
from stratagem.strategies.replicas import ReplicaPool
from stratagem.strategies.sharded import alias_parameters

logger = logging.getLogger(__name__)


class CentralStorageStrategy(MirroredStrategy):
    """Parameters and optimizer state once on a central device, computation replicated on every
    local device (tf.distribute.experimental.CentralStorageStrategy).

    Args:
        devices: the compute devices, in TF or torch spelling (`["/gpu:0", "cuda:1"]`,
            `["cpu:0", "cpu:1"]`). None: every visible GPU, or the CPU when there is none.
        parameter_device: where the parameters and the optimizer state live (`"cpu"`, `"cuda:0"`).
            None: the compute device when there is exactly one (the only GPU, say), else the CPU.
        share_parameters: replicas on the central device read its parameters in place (no copy).
            False gives every replica its own copy, refreshed at the start of every step.
        require_gpu: raise `GpuUnavailableError`, with the diagnosis, instead of computing on the CPU.
        timeout: seconds any replica waits for the others before failing with an error naming them.
        intra_op_threads: torch intra-op threads per CPU replica (default: shared evenly).
        batch_norm: "global" (default) or "per_replica", as for MirroredStrategy; with "global" the
            central copy holds the running statistics of the global batch.

    Example:
        >>> strategy = sg.CentralStorageStrategy(["cpu:0", "cpu:1"])     # parameters on the CPU
        >>> model, optimizer = strategy.distribute(net, torch.optim.Adam(net.parameters()))
        >>> for x, y in strategy.distribute_dataset(loader):
        ...     losses = strategy.run(train_step, args=(x, y))           # the same train_step as Mirrored
        ...     print(strategy.reduce("mean", losses))
    """

    def __init__(
        self,
        devices: Sequence[str | torch.device] | None = None,
        *,
        parameter_device: str | torch.device | None = None,
        share_parameters: bool = True,
        require_gpu: bool = False,
        timeout: float = 300.0,
        intra_op_threads: int | None = None,
        batch_norm: str = "global",
        registry: sg_devices.DeviceRegistry | None = None,
    ) -> None:
        if parameter_device is not None and not isinstance(parameter_device, (str, torch.device)):
            raise DeviceError(
                "parameter_device must be one device name. Received: "
                f"parameter_device={parameter_device!r} ({type(parameter_device).__name__}). "
                "Use e.g. parameter_device='cpu' or 'cuda:0' (TF spelling '/cpu:0' works too)."
            )
        if not isinstance(share_parameters, bool):
            raise InputError(
                f"share_parameters must be True or False. Received: share_parameters={share_parameters!r}. "
                "Use True (replicas on the central device read its parameters in place) or False (a copy each)."
            )
        super().__init__(devices, timeout=timeout, intra_op_threads=intra_op_threads, batch_norm=batch_norm,
                         registry=registry)
        if require_gpu and not any(d.type == "cuda" for d in self._devices):
            raise GpuUnavailableError(self._no_gpu_message(devices))
        self._share_parameters = share_parameters
        self._central_logical, storage = self._choose_parameter_device(parameter_device, registry)
        self._central_device = self._central_logical.physical
        # A replica "aliases" when it computes on the central device and shares its parameter storage.
        self._aliased = [share_parameters and d == self._central_device for d in self._devices]
        # The anchor's model IS the central copy, so its gradients are the central gradients (no staging).
        self._anchor = next((r for r, a in enumerate(self._aliased) if a), None)
        self._applier = self._anchor if self._anchor is not None else 0  # whose thread applies the update
        self._central: nn.Module | None = None
        self._central_params: list[nn.Parameter] = []
        self._replicas: list[nn.Module] = []
        chosen = [storage, self._copies_decision(), self._choose_reducer(), self._update_decision()]
        mine = [d for d in chosen if d is not None]
        inherited = [d for d in self._decisions if d.subject != "gradient combination"]
        self._decisions = [d for d in inherited if d.subject == "devices"] + mine + [
            d for d in inherited if d.subject != "devices"]

    # ---- placement ----------------------------------------------------------------------------
    def _no_gpu_message(self, devices: Sequence[str | torch.device] | None) -> str:
        if devices is not None:
            return (
                f"require_gpu=True, but the devices given are not GPUs. Received: devices={list(map(str, devices))}. "
                "Name GPUs (e.g. ['cuda:0', 'cuda:1']) or drop require_gpu."
            )
        reason = diagnose.gpu_unavailable_reason(diagnose.collect_facts(environ.current()))
        detail = f" {reason.reason} {reason.fix}" if reason is not None else ""
        return f"require_gpu=True, but no GPU can be used, so CentralStorageStrategy would compute on the CPU.{detail}"

    def _choose_parameter_device(
        self, parameter_device: str | torch.device | None, registry: sg_devices.DeviceRegistry | None
    ) -> tuple[sg_devices.LogicalDevice, PlacementDecision]:
        if parameter_device is not None:
            try:
                (logical,) = sg_devices.resolve_devices([parameter_device], registry=registry)
            except DeviceError as error:
                raise DeviceError(f"parameter_device={str(parameter_device)!r} cannot hold the parameters: {error}") from None
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
        central = self._central_device
        in_place = [r for r, a in enumerate(self._aliased) if a]
        by_choice = [r for r, d in enumerate(self._devices) if d == central and not self._aliased[r]]
        elsewhere = [r for r, d in enumerate(self._devices) if d != central]
        parts = []
        if in_place:
            parts.append(f"{self._describe(in_place)} compute on {central}, the central device, and read its "
                         "parameters in place (no copy)")
        if by_choice:
            parts.append(f"{self._describe(by_choice)} receive a copy of every parameter at the start of each step "
                         "(share_parameters=False)")
        if elsewhere:
            parts.append(f"{self._describe(elsewhere)} compute on another device than {central}, so they receive a "
                         "copy of every parameter at the start of each step")
        copied = len(by_choice) + len(elsewhere)
        choice = "none" if not copied else f"one per step to {copied} replica(s)"
        return PlacementDecision(subject="parameter copies", choice=choice, reason="; ".join(parts))

    def _choose_reducer(self) -> PlacementDecision | None:
        central = self._central_device
        if len(self._devices) == 1:
            if self._aliased[0]:
                return None  # one replica computing on the central parameters: nothing to combine or move
            return PlacementDecision(
                subject="gradient combination", choice="none (one replica)",
                reason=f"the replica's gradient is copied to {central} when optimizer.step() runs",
            )
        if all(self._aliased):
            # Every replica is a logical device of the central CPU: MirroredStrategy's in-memory reduction
            # already forms the weighted sum in the central memory, spread over the replica threads.
            return PlacementDecision(
                subject="gradient combination", choice=f"in-memory, on {central}",
                reason=f"every replica computes on {central}, the central device, so each replica thread sums 1/N of "
                "every weighted gradient in place there and writes the sum into every replica's gradient",
            )
        self._reducer = ReduceToCentralDevice(central, self._anchor)
        return PlacementDecision(
            subject="gradient combination", choice=f"reduce onto {central}",
            reason=f"each replica's weighted gradient is copied to {central} and summed there; the sum is copied back "
            "to every replica so that clipping in the step function sees the gradient of the global batch",
        )

    def _update_decision(self) -> PlacementDecision:
        central = self._central_device
        return PlacementDecision(
            subject="optimizer update", choice=f"once per step, on {central}",
            reason=f"every replica calls optimizer.step(); once all have, replica {self._applier} "
            f"({self._names[self._applier]}) applies the optimizer given to distribute() to the central parameters, "
            f"so its state exists once, on {central}",
        )

    def _describe(self, replicas: Sequence[int]) -> str:
        return "replica(s) " + ", ".join(f"{r} ({self._names[r]})" for r in replicas)

    @property
    def parameter_device(self) -> torch.device:
        """The device that holds the parameters and the optimizer state."""
        return self._central_device

    def explain(self) -> Explanation:
        base = super().explain()
        details = dict(base.details)
        details["parameter device"] = f"{self._central_logical.name} (runs on {self._central_device})"
        if self._central is not None:
            params = list(self._central.parameters())
            copies = sum(1 for a in self._aliased if not a)
            details["parameters"] = (
                f"{len(params)} tensors, {sum(p.numel() for p in params)} values, trained once on {self._central_device}"
                + (f"; {copies} replica(s) hold a compute copy, refreshed every step" if copies else "")
            )
        return Explanation(type(self).__name__, self.num_replicas_in_sync, base.replicas, base.decisions, details)

    # ---- distribute ---------------------------------------------------------------------------
    def distribute(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Places `model` on the central device, with a compute copy per replica; returns `(model,
        optimizer)` (the model alone without an optimizer). The optimizer given stays the one that
        updates: its state lives on the central device."""
        self._check_distribute_args(model, optimizer, self._model)
        check_optimizer_supported(optimizer, self.num_replicas_in_sync, type(self).__name__)
        self._check_memory(model, optimizer)
        central = model.to(self._central_device)
        if optimizer is not None and optimizer.state:
            optimizer.load_state_dict(optimizer.state_dict())  # moves existing state next to the central parameters
        replicas: list[nn.Module] = []
        for r, device in enumerate(self._devices):
            if r == self._anchor:
                replicas.append(central)
                continue
            replica = copy.deepcopy(central)
            if self._aliased[r]:
                alias_parameters([central, replica])
            else:
                replica = replica.to(device)
            replicas.append(replica)
        self._central = central
        self._central_params = [p for p in central.parameters() if p.requires_grad]
        self._replicas = replicas
        self._replica_params = [[p for p in r.parameters() if p.requires_grad] for r in replicas]
        self._install_batch_norm(replicas)
        if self._needs_gradient_sync():
            for r, params in enumerate(self._replica_params):
                for i, p in enumerate(params):
                    p.register_post_accumulate_grad_hook(self._make_grad_hook(r, i))
        if len(replicas) > 1:
            self._pool = ReplicaPool(self._names, self._setup_replica_thread, self._timeout)
        distributed = CentralModel(central, replicas, self)
        self._model = distributed
        logger.info("CentralStorageStrategy: parameters on %s, replicas on %s", self._central_device, self._names)
        if optimizer is None:
            return distributed
        central_optimizer = CentralOptimizer(optimizer, self)
        lr_schedulers.adopt_existing(optimizer, central_optimizer, gc.get_referrers)  # built before distribute
        return distributed, central_optimizer

    def _check_memory(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Before anything is copied: room for the central state (parameters, gradients, optimizer state)
        on the central device, and for a compute copy (parameters, gradients) on every other GPU."""
        central = self._central_logical
        needs = []
        if central.physical.type == "cuda":
            needs.append((central, diagnose.estimate_training_memory(model, optimizer),
                          "The central copy (parameters, gradients and optimizer state)",
                          ("Keep the parameters on the CPU (parameter_device='cpu'), or split the model across "
                           "devices (model parallelism).")))
        for device in self._logical:
            if device.physical.type == "cuda" and device.physical != central.physical:
                needs.append((device, diagnose.estimate_training_memory(model, None),
                              "A replica's compute copy (parameters and gradients)",
                              ("Compute on GPUs with more free memory, or split the model across devices (model "
                               "parallelism).")))
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
    def no_sync(self) -> Any:
        """Changes nothing here: central storage combines the replicas' gradients at every backward, so K
        backward passes give one device's sum with or without it (nothing is saved by skipping)."""
        return Strategy.no_sync(self)

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """Runs `fn` once per replica, in parallel, each with its slice of the distributed inputs
        (see `MirroredStrategy.run`); the central copy keeps the buffers of replica 0 (e.g. batch-norm
        statistics), as MirroredStrategy reports replica 0's."""
        result = super().run(fn, args, kwargs)
        if self._central is not None and self._anchor != 0:
            self._copy_buffers(self._replicas[0], self._central)
        return result

    def _begin_step(self, state: Any) -> None:
        self._refresh_replicas()

    def _refresh_replicas(self) -> None:
        """Hands every replica the current central parameters (those it does not read in place) and buffers."""
        central = self._central
        if central is None:
            return
        with torch.no_grad():
            for r, replica in enumerate(self._replicas):
                if r == self._anchor:
                    continue
                if not self._aliased[r]:
                    torch._foreach_copy_(list(replica.parameters()), list(central.parameters()))
                self._copy_buffers(central, replica)

    @staticmethod
    def _copy_buffers(source: nn.Module, target: nn.Module) -> None:
        buffers = list(target.buffers())
        if buffers:
            with torch.no_grad():
                torch._foreach_copy_(buffers, list(source.buffers()))

    def _apply_update(self, optimizer: torch.optim.Optimizer, closure: Any) -> Any:
        """`optimizer.step()` from each replica: the first to come waits for the others, one applies it."""
        if closure is not None:
            raise InputError(
                "CentralStorageStrategy applies optimizer.step() once, on the central device, so a closure that "
                f"re-evaluates the loss cannot run on every replica. Received: closure={closure!r}. Call "
                "optimizer.step() without a closure, or use MirroredStrategy(share_parameters=False) for such optimizers."
            )
        replica = self._current_replica()
        if replica is None:
            if len(self._devices) > 1:
                raise InputError(
                    "optimizer.step() ran outside strategy.run(), where the replicas' gradients are not combined. "
                    f"Received: a call with {len(self._devices)} replicas and no step running. Call it in the "
                    "function given to strategy.run()."
                )
            replica = 0
        state = self._run_state
        together = len(self._devices) > 1 and state is not None
        if together:
            assert state is not None  # together needs a running step
            # Nobody may still read the parameters this update overwrites (replicas on the central device share them).
            self._barrier.wait(replica, "optimizer step", state.step)
        result = None
        if replica == self._applier:
            if state is not None:  # outside a step (one replica) the central gradients are the user's own
                self._stage_gradients()
            result = optimizer.step()
        if together:
            assert state is not None
            # Nobody reads the parameters (or steps again) before the update is complete.
            self._barrier.wait(replica, "end of the optimizer step", state.step)
        return result

    def _stage_gradients(self) -> None:
        """Without an anchor the central parameters have no gradients of their own: copy the applier's
        (combined, and clipped if the step function clipped) gradients to the central device."""
        if self._anchor is not None:
            return
        with torch.no_grad():
            for central, mine in zip(self._central_params, self._replica_params[self._applier]):
                if mine.grad is None:
                    central.grad = None
                    continue
                if central.grad is None:
                    central.grad = torch.empty_like(central)
                central.grad.copy_(mine.grad)

    def _zero_grad(self, set_to_none: bool) -> None:
        """Inside a step: the running replica's gradients; outside: every replica's and the central ones."""
        replica = self._current_replica()
        if replica is None:
            targets: list[nn.Module | None] = [self._central] if self._central is not None else []
            targets += self._replicas
        else:
            targets = [self._replicas[replica]]
            if replica == self._applier and self._anchor is None:
                targets.append(self._central)
        for module in targets:
            if module is not None:
                module.zero_grad(set_to_none)
