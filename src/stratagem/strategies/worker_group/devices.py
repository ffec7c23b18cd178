"""Which GPU each worker process takes by default.

One GPU per local rank (torchrun's LOCAL_RANK, SLURM's SLURM_LOCALID, the local rank `stratagem
launch` and TF_CONFIG give, all resolved into the `Cluster` value). Binding it before the process
group forms, and refusing two ranks on one GPU of a machine, is `cluster.worker_group`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stratagem.cluster import Cluster
from stratagem.diagnose import PlacementDecision
from stratagem.errors import InputError


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
