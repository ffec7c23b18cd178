"""Which device a sharded worker process takes when none is given: the GPU of its local rank.

ShardedStrategy runs one device per process, so when several worker processes share a machine
(torchrun, `stratagem launch`, SLURM) each takes the GPU of its local rank, as MultiWorkerMirrored's
workers do (worker_group/devices.py), not the first visible GPU, which every local rank would share.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stratagem import environ
from stratagem.cluster import Cluster, resolve_cluster
from stratagem.diagnose import PlacementDecision
from stratagem.strategies.worker_group.devices import default_local_devices


def local_device(cluster: Cluster, env: Mapping[str, str], registry: Any = None) -> tuple[str, PlacementDecision]:
    """This worker's one device: the GPU of its local rank, the first GPU of a process alone on its machine, or
    the CPU; with the decision `explain()` and `stratagem train` show."""
    chosen, decision = default_local_devices(cluster, env, registry)
    device = chosen[0]
    if device.startswith("cpu"):
        return "cpu", PlacementDecision(subject="devices", choice="cpu", reason=decision.reason)
    if len(chosen) > 1:
        why = f"{decision.reason}; one device per sharded worker process: the first"
        return device, PlacementDecision(subject="devices", choice=device, reason=why)
    return device, decision


def default_devices(name: str, registry: Any) -> tuple[list[str], PlacementDecision]:
    """The strategy record's choice (`stratagem train --strategy sharded`): this process's `local_device`."""
    env = environ.current()
    device, decision = local_device(resolve_cluster(None, env=env), env, registry)
    return [device], decision
