"""Who the processes of a training job are, how they meet, and a launcher for local clusters.

>>> from stratagem import environ
>>> from stratagem.cluster import resolve_cluster
>>> cluster = resolve_cluster(env=environ.current())   # TF_CONFIG, torchrun, SLURM, or one process
>>> print(cluster.explain())                            # doctest: +SKIP

`init_process_group` (the rendezvous, which imports torch.distributed) is imported when first used, so that
`stratagem launch` starts its tasks without torch; the rest is plain Python.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stratagem.cluster.attempt import Recovery, StopRequest, TaskFailure
from stratagem.cluster.launch import (
    LaunchResult,
    free_ports,
    launch,
    launched_by_stratagem,
    relaunch,
    task_environments,
)
from stratagem.cluster.nodelist import expand_nodelist, expand_tasks_per_node, first_host, tasks_on_node
from stratagem.cluster.processes import OutputLine, describe_exit
from stratagem.cluster.resolve import from_slurm, from_torchrun, resolve_cluster, single_process, slurm_master_port
from stratagem.cluster.spec import TASK_TYPES, Cluster
from stratagem.cluster.tf_config import parse_tf_config, split_address

if TYPE_CHECKING:
    from stratagem.cluster.rendezvous import init_process_group


def __getattr__(name: str) -> Any:
    """`cluster.init_process_group`, imported when first used (with torch.distributed)."""
    if name != "init_process_group":
        raise AttributeError(f"module 'stratagem.cluster' has no attribute {name!r}")
    value = importlib.import_module("stratagem.cluster.rendezvous").init_process_group
    globals()[name] = value
    return value


__all__ = [
    "TASK_TYPES",
    "Cluster",
    "LaunchResult",
    "OutputLine",
    "Recovery",
    "StopRequest",
    "TaskFailure",
    "describe_exit",
    "expand_nodelist",
    "expand_tasks_per_node",
    "first_host",
    "free_ports",
    "from_slurm",
    "from_torchrun",
    "init_process_group",
    "launch",
    "launched_by_stratagem",
    "parse_tf_config",
    "relaunch",
    "resolve_cluster",
    "single_process",
    "slurm_master_port",
    "split_address",
    "task_environments",
    "tasks_on_node",
]
