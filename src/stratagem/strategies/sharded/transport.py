"""How a unit's all-gather and reduce-scatter cross the workers: one host's shared memory, else the process group.

FSDP2 hands its collectives to the process group: on the CPU that is Gloo, whose all-gather and
reduce-scatter move every byte through loopback TCP. On the 12.6M-parameter MLP at 2 processes the
all-gathers took most of a stage-2 step (benchmarks/reports/2026-12-02-cpu-2vcpu-sharded-speed.md).
When every worker runs on this host, the strategy connects the same shared-memory group that
MultiWorkerMirroredStrategy sums through (`stratagem.shm.sums`, docs/shared_memory.md) and installs
FSDP2's extension points on every unit (`set_custom_all_gather`, `set_custom_reduce_scatter`,
reduce_scatter.py): a rank copies its shard into its slot of the shared file and reads every slot
back (all-gather), or copies its gradients in and sums its own block straight out of every rank's
slot, in rank order (reduce-scatter). Where shared memory is not possible (several hosts, GPUs
under NCCL, another platform, `STRATAGEM_SHARED_MEMORY=0`, `shared_memory=False`) the same
extension points call the process group, and `explain()` says which path was taken and why.
"""

from __future__ import annotations

import logging

import torch

from stratagem.cluster.worker_group import WorkerGroup
from stratagem.diagnose import PlacementDecision
from stratagem.errors import InputError

logger = logging.getLogger(__name__)


def connect_transport(group: WorkerGroup, device: torch.device, wanted: bool | None) -> PlacementDecision:
    """Every rank calls this once, at start-up: connects `group.cross_worker.shared` where it can (and `wanted` is
    not False); returns the decision for `explain()`. `wanted=True` where shared memory is impossible is refused."""
    if group.backend == "nccl":
        if wanted:
            raise InputError(
                "shared_memory=True moves CPU tensors, but this worker's shards are on a GPU, which uses NCCL. "
                f"Received: device={device}. Leave shared_memory unset for GPUs."
            )
        return _decision(None, "nccl", "the shards are on GPUs, which gather and reduce through NCCL")
    cw = group.cross_worker
    why, fell_back = cw.connect_shared_memory(
        wanted=wanted is not False, why_not=None if device.type == "cpu" else "the shards are on GPUs without NCCL"
    )
    if wanted and cw.shared is None:
        raise InputError(
            f"shared_memory=True, but the workers cannot share memory. Received: {why}. "
            "Leave shared_memory unset to use Gloo in that case."
        )
    if fell_back and group.is_chief:
        logger.warning(
            "Every worker runs on this host, but parameters and gradients cross workers through Gloo's loopback "
            "TCP, which is slower than shared memory: %s. Make room in /dev/shm (a container's --shm-size), or "
            "pass shared_memory=False to keep Gloo without this warning.",
            why,
        )
    return _decision(cw.shared, group.backend, why)


def _decision(shared: object | None, backend: str, why: str) -> PlacementDecision:
    if shared is None:
        return PlacementDecision(
            subject="all-gather and reduce-scatter", choice=f"the process group ({backend})", reason=why
        )
    return PlacementDecision(
        subject="all-gather and reduce-scatter",
        choice="shared memory",
        reason=why.replace("gradients are summed", "shards are gathered and gradients reduced"),
    )
