"""Which GPU each worker process takes, and binding it before the process group forms.

One GPU per local rank by default (torchrun's LOCAL_RANK, SLURM's SLURM_LOCALID, the local rank
`stratagem launch` and TF_CONFIG give, all resolved into the `Cluster` value), never two ranks on
one GPU of a machine; the worker's first GPU becomes the current CUDA device before
``init_process_group``, which gets it as ``device_id``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from stratagem.cluster import Cluster, init_process_group
from stratagem.collective.cross_worker import ROLL_CALL_SECONDS
from stratagem.diagnose import PlacementDecision
from stratagem.errors import InputError

NCCL_TIMEOUT_MARGIN_S = 30.0
"""How much longer than stratagem's own deadline and roll call torch's NCCL watchdog waits for a collective.

torch's NCCL watchdog ends a collective at the process group's timeout (by default tearing the
process down with its own message); stratagem's watchdog must come first, so that the error names
who is missing. Its clock starts when the host hands a collective over, which can be the rest of a
backward pass after torch's starts (a bucket queued early); the margin covers that, the roll call's
store calls and the stall warning's read of the steps reached, with room to spare."""


def process_group_timeout(backend: str, timeout: float) -> float:
    """The process group's own timeout: under NCCL the strategy's timeout plus two roll calls (the call and
    the read of the steps reached after it) plus `NCCL_TIMEOUT_MARGIN_S`; under Gloo the strategy's timeout,
    which the host path's own waits come before anyway (it polls, then waits on finished work only)."""
    if backend == "nccl":
        return timeout + 2 * ROLL_CALL_SECONDS + NCCL_TIMEOUT_MARGIN_S
    return timeout


def default_local_devices(
    cluster: Cluster, env: Mapping[str, str], registry: Any
) -> tuple[list[str], PlacementDecision]:
    """This worker's devices when none are given: its share of the GPUs, else CPU devices.

    STRATAGEM_DEVICES_PER_WORKER (set by `stratagem launch --devices-per-worker K`) gives K devices to
    each worker: GPUs [local_rank * K, (local_rank + 1) * K) or logical CPUs cpu:0..cpu:K-1. Without
    it: one GPU per local process when several share the machine (as torchrun starts them), every GPU
    for a single process, or one CPU device.
    """
    from stratagem import devices as sg_devices

    registry = registry or sg_devices.default_registry
    gpus = [d.name for d in registry.get_logical_devices("cuda")]
    local_rank = cluster.local_rank or 0
    per_worker_text = env.get("STRATAGEM_DEVICES_PER_WORKER")
    if per_worker_text is not None:
        try:
            per_worker = int(per_worker_text)
            if per_worker < 1:
                raise ValueError
        except ValueError:
            raise InputError(
                f"STRATAGEM_DEVICES_PER_WORKER must be a positive integer. Received: {per_worker_text!r}. "
                "Use stratagem launch --devices-per-worker K."
            ) from None
        if gpus:
            chosen = gpus[local_rank * per_worker : (local_rank + 1) * per_worker]
            if len(chosen) < per_worker:
                raise InputError(
                    f"{cluster.task_name} (local rank {local_rank}) needs {per_worker} GPUs but only {len(gpus)} are "
                    f"visible for {cluster.local_world_size} local workers. Lower --devices-per-worker or start "
                    "fewer workers per machine."
                )
            why = f"--devices-per-worker {per_worker}: GPUs of local rank {local_rank}"
        else:
            chosen = [f"cpu:{i}" for i in range(per_worker)]
            why = f"--devices-per-worker {per_worker} and no GPU: logical CPU devices"
        return chosen, PlacementDecision(subject="devices", choice=", ".join(chosen), reason=why)
    bound = env.get("CUDA_VISIBLE_DEVICES") is not None and 0 < len(gpus) < cluster.local_world_size
    if gpus and cluster.local_world_size > 1 and bound:
        # Fewer GPUs visible than processes on this machine, under a CUDA_VISIBLE_DEVICES: the launcher bound
        # GPUs to each process (SLURM's --gpus-per-task, a per-rank CUDA_VISIBLE_DEVICES), so all it sees is its own.
        chosen = gpus
        why = (
            f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r} shows this process {len(gpus)} GPU(s) for "
            f"{cluster.local_world_size} local worker processes: the GPUs its launcher bound to it"
        )
    elif gpus and cluster.local_world_size > 1:
        if local_rank >= len(gpus):
            raise InputError(
                f"{cluster.task_name} is local rank {local_rank} of {cluster.local_world_size} on this machine but only "
                f"{len(gpus)} GPU(s) are visible. Start at most {len(gpus)} workers per machine."
            )
        chosen = [gpus[local_rank]]
        why = f"one GPU per local worker process (local rank {local_rank} of {cluster.local_world_size})"
    elif gpus:
        chosen, why = gpus, f"every visible GPU ({len(gpus)}) for the only worker process on this machine"
    else:
        chosen, why = ["cpu:0"], "no visible GPU: one CPU replica per worker process"
    return chosen, PlacementDecision(subject="devices", choice=", ".join(chosen), reason=why)


def ranks_sharing_a_gpu(
    placements: Sequence[tuple[str, str | None, Sequence[int]]],
) -> tuple[tuple[int, int], int] | None:
    """The first two ranks that hold the same GPU of one machine, and that GPU's index; None if none do.

    A placement is (host name, CUDA_VISIBLE_DEVICES, cuda indices): indices count within one
    CUDA_VISIBLE_DEVICES, so ranks with different values (bound by their launcher) never collide here.
    """
    seen: dict[tuple[str, str | None, int], int] = {}
    for rank, (host, visible, indices) in enumerate(placements):
        for index in indices:
            other = seen.setdefault((host, visible, index), rank)
            if other != rank:
                return (other, rank), index
    return None


def start_process_group(
    cluster: Cluster,
    devices: Sequence[torch.device],
    backend: str,
    timeout: float,
    *,
    token: str | None,
    agent_store: str | None = None,
) -> Any:
    """Binds this process to its first GPU, then forms the process group with that device.

    The current CUDA device must be set before the process group exists: NCCL's communicator and the
    object collectives (all_gather_object) use `torch.cuda.current_device()`, which is cuda:0 in every
    process that never set it, so every rank of a machine would land on GPU 0. `device_id` makes NCCL
    form its communicator at once, on that device (and report an NCCL start-up error here, not at the
    first all-reduce). The group's own timeout is `process_group_timeout` (longer under NCCL).
    """
    first = devices[0] if devices else torch.device("cpu")
    device_id = None
    if first.type == "cuda":
        index = first.index if first.index is not None else 0
        torch.cuda.set_device(index)
        if backend == "nccl":
            device_id = torch.device("cuda", index)
    return init_process_group(
        cluster,
        backend,
        timeout,
        token=token,
        device_id=device_id,
        agent_store=agent_store,
        group_timeout=process_group_timeout(backend, timeout),
    )
