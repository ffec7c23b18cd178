"""Where the replicas of a data-parallel strategy go: devices, one replica per GPU, threads, parameter
sharing, memory.

Each decision is a plain function that takes what it needs and returns its value with the
`PlacementDecision` that `explain()` reports (None where there is nothing to say); `place_replicas`
makes the placement part, `ReplicaDevices`, which keeps the decisions it made. A decision that
cannot be honoured raises: a GPU asked for but absent, two replicas on one GPU, a replica without
the memory its training state needs, parameters that cannot be shared although share_parameters=True.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from stratagem import devices as sg_devices
from stratagem import diagnose, environ
from stratagem.cluster import allocator
from stratagem.diagnose import PlacementDecision
from stratagem.errors import GpuUnavailableError, InputError, MemoryEstimateError
from stratagem.strategies.data_parallel.cpu_threads.shared_parameters import why_not_shareable


@dataclass(frozen=True)
class ReplicaDevices:
    """The placement part: each local replica's logical device, the intra-op threads of a CPU replica, and
    the decisions that chose them (devices, GPU memory limits, threads)."""

    logical: list[sg_devices.LogicalDevice]
    threads: int | None
    """torch intra-op threads per CPU replica (None without CPU replicas)."""
    recorded: tuple[PlacementDecision, ...]

    @property
    def devices(self) -> list[torch.device]:
        """The torch device each replica runs on."""
        return [d.physical for d in self.logical]

    @property
    def names(self) -> list[str]:
        """Each replica's logical device name ("cpu:1", "cuda:0")."""
        return [d.name for d in self.logical]

    def decisions(self) -> list[PlacementDecision]:
        recorded = list(self.recorded)
        if sum(1 for d in self.devices if d.type == "cpu") > 1:
            recorded.append(host_memory_decision())
        return recorded

    def details(self) -> dict[str, str]:
        return {}


def host_memory_decision() -> PlacementDecision:
    """How this process treats freed host memory (read when asked: the setting is the process's), for CPU replicas
    that are threads of one process: each step's page faults then wait on the process's one memory map, and a
    replica held there makes the others wait at the next meeting (a BatchNorm layer's, the end of backward)."""
    choice, why = allocator.describe(environ.current())
    if choice == "returned to the system":
        why += (
            "; with several CPU replicas in one process the page faults of each step wait on each other, and a "
            f"replica held there makes the others wait at the next meeting: start Python with "
            f"GLIBC_TUNABLES={allocator.KEEP_TUNABLES} (a user's process is left as it is)"
        )
    return PlacementDecision(subject="freed host memory", choice=choice, reason=why)


def place_replicas(
    devices: Sequence[str | torch.device] | None,
    *,
    require_gpu: bool,
    registry: sg_devices.DeviceRegistry | None,
    intra_op_threads: int | None,
    devices_decision: PlacementDecision | None = None,
) -> ReplicaDevices:
    """Resolves the replicas' devices and their threads. `devices_decision`: why these devices, when the
    caller chose them (a worker's own GPU) rather than the user."""
    chosen, decision = choose_devices(devices, require_gpu, registry)
    recorded = [devices_decision if devices_decision is not None else decision]
    physical = [d.physical for d in chosen]
    check_one_replica_per_gpu(physical, [d.name for d in chosen])
    for choice, why in sg_devices.enforce_memory_limits(chosen):
        recorded.append(PlacementDecision(subject="GPU memory limit", choice=choice, reason=why))
    threads, threads_decision = choose_threads(physical, intra_op_threads)
    if threads_decision is not None:
        recorded.append(threads_decision)
    return ReplicaDevices(list(chosen), threads, tuple(recorded))


def choose_devices(
    devices: Sequence[str | torch.device] | None, require_gpu: bool, registry: sg_devices.DeviceRegistry | None
) -> tuple[list[sg_devices.LogicalDevice], PlacementDecision]:
    """The replicas' devices: those given, or every visible GPU (the CPU when there is none)."""
    if devices is None:
        chosen, decision = sg_devices.default_devices(registry=registry)
        if require_gpu and not any(d.physical.type == "cuda" for d in chosen):
            facts = diagnose.collect_facts(_env())
            reason = diagnose.gpu_unavailable_reason(facts)
            detail = f" {reason.reason} {reason.fix}" if reason is not None else ""
            raise GpuUnavailableError(
                f"require_gpu=True, but no GPU can be used, so MirroredStrategy would run on the CPU.{detail}"
            )
        return chosen, decision
    chosen = sg_devices.resolve_devices(devices, registry=registry)
    if require_gpu and not any(d.physical.type == "cuda" for d in chosen):
        raise GpuUnavailableError(
            f"require_gpu=True, but the devices given are not GPUs. Received: devices={list(map(str, devices))}. "
            "Name GPUs (e.g. ['cuda:0', 'cuda:1']) or drop require_gpu."
        )
    names = ", ".join(d.name for d in chosen)
    return chosen, PlacementDecision(subject="devices", choice=names, reason="given by devices=")


def check_one_replica_per_gpu(devices: Sequence[torch.device], names: Sequence[str]) -> None:
    """Refuses two replicas on one physical GPU."""
    gpus = [d for d in devices if d.type == "cuda"]
    shared = sorted({str(d) for d in gpus if gpus.count(d) > 1})
    if shared:
        raise InputError(
            f"MirroredStrategy runs at most one replica per physical GPU. Received: several logical GPUs on "
            f"{', '.join(shared)} ({', '.join(names)}). torch runs the backward passes of one GPU on a single "
            "autograd thread, so replicas sharing it would wait for each other forever at the end of backward. "
            "Use one logical GPU per physical GPU, or MultiWorkerMirroredStrategy with one process per replica."
        )


def choose_threads(
    devices: Sequence[torch.device], intra_op_threads: int | None
) -> tuple[int | None, PlacementDecision | None]:
    """torch intra-op threads per CPU replica (None, and no decision, without CPU replicas)."""
    num_cpu = sum(1 for d in devices if d.type == "cpu")
    if num_cpu == 0:
        return None, None
    if intra_op_threads is not None and intra_op_threads < 1:
        raise InputError(f"intra_op_threads must be at least 1. Received: intra_op_threads={intra_op_threads}.")
    threads, why = share_intra_op_threads(num_cpu, intra_op_threads, "replica")
    # Said for one CPU replica too (OneDevice, one replica per worker): the same rule gives it every thread.
    return threads, PlacementDecision(subject="intra-op threads per CPU replica", choice=str(threads), reason=why)


def share_intra_op_threads(num_cpu: int, intra_op_threads: int | None, what: str) -> tuple[int, str]:
    """torch intra-op threads for each of `num_cpu` CPU `what`s ("replica", "stage") that run at once, and why:
    `intra_op_threads` where given, else the process's threads shared among them (at least one each)."""
    if intra_op_threads is not None:
        return intra_op_threads, "given by intra_op_threads="
    total = torch.get_num_threads()
    return max(1, total // num_cpu), (
        f"the process's {total} intra-op thread(s) shared among {num_cpu} CPU {what}(s), so {what}s "
        "running at once do not oversubscribe the cores"
    )


def check_memory(
    logical: Sequence[sg_devices.LogicalDevice], model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """Before anything is copied: does each GPU replica have room for the model's training state?"""
    gpus = [d for d in logical if d.physical.type == "cuda"]
    if not gpus:
        return
    estimate = diagnose.estimate_training_memory(model, optimizer)
    held = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None)]
    if optimizer is not None:
        held += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for device in gpus:
        # The replica on the model's own GPU is the model itself: what it holds there is no new memory.
        resident = sg_devices.resident_bytes(held, device.physical) if device is logical[0] else 0
        known = device.memory_room(resident_bytes=resident)
        if known is None:
            continue
        room, what = known
        if estimate.total_bytes > room:
            raise MemoryEstimateError(
                f"Replica on {device.name} needs at least {estimate.describe()}, but {what} is "
                f"{diagnose.format_bytes(room)}. Options: fewer replicas per GPU or a GPU with more memory, "
                "central storage (parameters and optimizer state on one device), or model parallelism "
                "(the model split across devices)."
            )


def decide_sharing(
    devices: Sequence[torch.device],
    share_parameters: bool | None,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> tuple[bool, PlacementDecision | None]:
    """Whether the replicas share one copy of the parameters (see strategies/data_parallel/cpu_threads/shared_parameters.py); no decision
    for one replica."""
    if len(devices) == 1:
        return False, None
    if len(set(devices)) != 1:
        reason: str | None = "the replicas are on different physical devices"
    elif optimizer is None:
        # Without an optimizer the step updates the parameters by hand (`p.data.add_(p.grad, alpha=-lr)`): every
        # replica applies the combined gradient, which is exact only on a copy of its own. On one shared copy
        # each update would land on the same memory, N times per step.
        reason = (
            "no optimizer was given to distribute(), so a step that updates the parameters by hand does so on every "
            "replica, each on its own copy, once per step"
        )
    else:
        reason = why_not_shareable(optimizer, model)
    if share_parameters is False:
        shared, why = False, "share_parameters=False"
    elif reason is not None:
        if share_parameters:
            raise InputError(
                f"share_parameters=True, but the replicas cannot share parameters: {reason}. "
                "Drop share_parameters=True to keep a private copy per replica."
            )
        shared, why = False, reason
    else:
        shared = True
        why = (
            f"all replicas run on {devices[0]}, so they read one copy of the parameters and each "
            f"updates 1/{len(devices)} of it (optimizer state exists once); update parameters only "
            "through the optimizer"
        )
    choice = "shared, update sharded" if shared else "a private copy per replica"
    return shared, PlacementDecision(subject="parameter storage", choice=choice, reason=why)


def nccl_available(devices: Sequence[torch.device]) -> bool:
    """Whether `torch.cuda.nccl` can all-reduce across these replicas' GPUs, touching no device.

    NCCL serves only replicas on two or more distinct GPUs; for any other set nothing is probed, so a
    CPU strategy never starts CUDA (a context costs about 0.5 GiB on the GPU it lands on). The probe is
    the build's NCCL binding, not an allocation: `nccl.is_available(tensors)` would need tensors on a GPU.
    """
    if len({d for d in devices if d.type == "cuda"}) < 2:
        return False
    return hasattr(torch._C, "_nccl_all_reduce")


def _env() -> Mapping[str, str]:
    from stratagem import environ

    return environ.current()
