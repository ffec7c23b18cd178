"""Who the processes of a training job are, how they meet, and a launcher for local clusters.

>>> from stratagem import environ
>>> from stratagem.cluster import resolve_cluster
>>> cluster = resolve_cluster(env=environ.current())   # TF_CONFIG, torchrun, SLURM, or one process
>>> print(cluster.explain())                            # doctest: +SKIP
"""

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
