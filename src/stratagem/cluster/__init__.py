"""Who the processes of a training job are, how they meet, and a launcher for local clusters.

>>> from stratagem import environ
>>> from stratagem.cluster import resolve_cluster
>>> cluster = resolve_cluster(env=environ.current())   # TF_CONFIG, torchrun, SLURM, or one process
>>> print(cluster.explain())                            # doctest: +SKIP

Each name is imported when first used: `stratagem launch` imports the launcher and its processes, not
the rendezvous (torch.distributed) it never calls.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stratagem.cluster.launch import (
        LaunchResult,
        Recovery,
        TaskFailure,
        free_ports,
        launch,
        launched_by_stratagem,
        relaunch,
        task_environments,
    )
    from stratagem.cluster.nodelist import expand_nodelist, expand_tasks_per_node, first_host, tasks_on_node
    from stratagem.cluster.processes import OutputLine, describe_exit
    from stratagem.cluster.rendezvous import init_process_group
    from stratagem.cluster.resolve import from_slurm, from_torchrun, resolve_cluster, single_process, slurm_master_port
    from stratagem.cluster.spec import TASK_TYPES, Cluster
    from stratagem.cluster.tf_config import parse_tf_config, split_address

# name -> the module that defines it
_LAZY: dict[str, str] = {
    "LaunchResult": "stratagem.cluster.launch",
    "Recovery": "stratagem.cluster.launch",
    "TaskFailure": "stratagem.cluster.launch",
    "free_ports": "stratagem.cluster.launch",
    "launch": "stratagem.cluster.launch",
    "launched_by_stratagem": "stratagem.cluster.launch",
    "relaunch": "stratagem.cluster.launch",
    "task_environments": "stratagem.cluster.launch",
    "expand_nodelist": "stratagem.cluster.nodelist",
    "expand_tasks_per_node": "stratagem.cluster.nodelist",
    "first_host": "stratagem.cluster.nodelist",
    "tasks_on_node": "stratagem.cluster.nodelist",
    "OutputLine": "stratagem.cluster.processes",
    "describe_exit": "stratagem.cluster.processes",
    "init_process_group": "stratagem.cluster.rendezvous",
    "from_slurm": "stratagem.cluster.resolve",
    "from_torchrun": "stratagem.cluster.resolve",
    "resolve_cluster": "stratagem.cluster.resolve",
    "single_process": "stratagem.cluster.resolve",
    "slurm_master_port": "stratagem.cluster.resolve",
    "TASK_TYPES": "stratagem.cluster.spec",
    "Cluster": "stratagem.cluster.spec",
    "parse_tf_config": "stratagem.cluster.tf_config",
    "split_address": "stratagem.cluster.tf_config",
}


def __getattr__(name: str) -> Any:
    """`cluster.<name>` for a name of `__all__` not imported yet: imports its module."""
    if name not in _LAZY:
        raise AttributeError(f"module 'stratagem.cluster' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "TASK_TYPES",
    "Cluster",
    "LaunchResult",
    "OutputLine",
    "Recovery",
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
