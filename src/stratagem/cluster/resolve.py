"""Resolve the ``Cluster`` this process belongs to, from the first source that describes one.

Order: an explicit argument, then the first of `SOURCES` whose variables are set (TF_CONFIG,
torchrun's variables, SLURM's variables), else one process. Every source is parsed strictly: a half-set source is an error, never skipped, because
skipping it would silently train one model per process instead of one model.

SLURM rendezvous port: ``STRATAGEM_MASTER_PORT``, else ``MASTER_PORT``, else
``20000 + SLURM_JOB_ID % 10000``. The derived port is the same on every node of a job without any
coordination, sits below Linux's ephemeral range (32768-60999) so the kernel does not hand it to
an outgoing connection, and differs between jobs that share a node unless their ids are 10000
apart; set ``STRATAGEM_MASTER_PORT`` when that matters.

Start SLURM tasks with ``srun``: a batch script run without it is one process that may still see
``SLURM_NTASKS > 1``; its rendezvous then times out naming the ranks that never started.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from stratagem.cluster.nodelist import first_host, tasks_on_node
from stratagem.cluster.spec import SHOWN, Cluster, show
from stratagem.cluster.tf_config import parse_tf_config
from stratagem.errors import ClusterError

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 10000


# ASCII digits only (str.isdigit also accepts '²', which int() refuses), and few enough that int() is cheap.
_WHOLE_NUMBER = re.compile(r"\s*([0-9]{1,18})\s*")
# A host name or address: DNS names are at most 253 characters, and none holds spaces or control characters.
_HOST = re.compile(r"[^\s\x00-\x1f\x7f]{1,255}")


def _int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    value = env[name]
    match = _WHOLE_NUMBER.fullmatch(value) if isinstance(value, str) else None
    if match is None or int(match.group(1)) < minimum:
        raise ClusterError(
            f"{name} is not an integer >= {minimum}. Received: {name}={show(value)}. "
            f"Set {name} to a whole number (ASCII digits, at most 18), or unset it."
        )
    return int(match.group(1))


def _host(name: str, value: Any, how: str) -> str:
    if isinstance(value, str) and not value.strip():
        raise ClusterError(f"{name} is empty. Received: {how}={show(value)}. Set it to the chief's host.")
    if not isinstance(value, str) or not _HOST.fullmatch(value.strip()):
        raise ClusterError(
            f"{name} is not a host name or address. Received: {how}={show(value)}. "
            f"Set {name} to the chief's host (1-255 characters, no spaces)."
        )
    return value.strip()


def _port(name: str, value: int) -> int:
    if not 1 <= value <= 65535:
        raise ClusterError(f"{name} is not a valid port. Received: {name}={value}. Use a port in 1..65535.")
    return value


def _check_rank(rank_name: str, rank: int, size_name: str, size: int) -> None:
    if rank >= size:
        raise ClusterError(
            f"{rank_name} must be smaller than {size_name}. Received: {rank_name}={rank}, {size_name}={size}. "
            f"Give each of the {size} processes a distinct {rank_name} in 0..{size - 1}."
        )


def from_torchrun(env: Mapping[str, str]) -> Cluster:
    """The cluster torchrun describes with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT.

    Every process is a ``worker`` with ``task_index == rank``; worker 0 is the chief.
    """
    missing = [name for name in TORCHRUN_VARIABLES if name not in env]
    if missing:
        present = {name: env[name][:40] for name in TORCHRUN_VARIABLES if name in env}
        raise ClusterError(
            f"torchrun's variables are only partly set: {', '.join(missing)} missing. Received: {present}. "
            f"Launch with torchrun (it sets all of {', '.join(TORCHRUN_VARIABLES)}), set the missing ones, "
            "or unset RANK and WORLD_SIZE to run one process."
        )
    rank, world_size = _int(env, "RANK"), _int(env, "WORLD_SIZE", minimum=1)
    local_rank, local_world_size = _int(env, "LOCAL_RANK"), _int(env, "LOCAL_WORLD_SIZE", minimum=1)
    _check_rank("RANK", rank, "WORLD_SIZE", world_size)
    _check_rank("LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", local_world_size)
    if local_world_size > world_size:
        raise ClusterError(
            f"LOCAL_WORLD_SIZE cannot exceed WORLD_SIZE. Received: LOCAL_WORLD_SIZE={local_world_size}, "
            f"WORLD_SIZE={world_size}. LOCAL_WORLD_SIZE counts the processes on this host only."
        )
    master_addr = _host("MASTER_ADDR", env["MASTER_ADDR"], "MASTER_ADDR")
    master_port = _port("MASTER_PORT", _int(env, "MASTER_PORT"))
    return _rank_worker(
        rank,
        world_size,
        local_rank,
        local_world_size,
        master_addr,
        master_port,
        "torchrun",
        tuple(f"{name}={env[name]}" for name in TORCHRUN_VARIABLES),
    )


def slurm_master_port(env: Mapping[str, str]) -> tuple[int, str]:
    """The rendezvous port of a SLURM job and why (see the module docstring)."""
    for name in ("STRATAGEM_MASTER_PORT", "MASTER_PORT"):
        if name in env:
            return _port(name, _int(env, name)), f"{name}={env[name]}"
    if "SLURM_JOB_ID" not in env:
        raise ClusterError(
            "Cannot choose a rendezvous port under SLURM: SLURM_JOB_ID is not set. "
            f"Received: SLURM_PROCID={show(env.get('SLURM_PROCID'))}. Set STRATAGEM_MASTER_PORT to a free port."
        )
    job_id = _int(env, "SLURM_JOB_ID")
    port = SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN
    return port, f"port {port} = {SLURM_PORT_BASE} + SLURM_JOB_ID ({job_id}) % {SLURM_PORT_SPAN}"


def _slurm_local_world_size(env: Mapping[str, str]) -> tuple[int, str]:
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int(env, "SLURM_NTASKS_PER_NODE", minimum=1), f"SLURM_NTASKS_PER_NODE={env['SLURM_NTASKS_PER_NODE']}"
    if "SLURM_TASKS_PER_NODE" in env and "SLURM_NODEID" in env:
        node = _int(env, "SLURM_NODEID")
        tasks = tasks_on_node(env["SLURM_TASKS_PER_NODE"], node)
        return tasks, f"SLURM_TASKS_PER_NODE={env['SLURM_TASKS_PER_NODE'][:SHOWN]} on node {node}"
    raise ClusterError(
        "Cannot tell how many tasks run on this node. Received: neither SLURM_NTASKS_PER_NODE nor "
        "SLURM_TASKS_PER_NODE with SLURM_NODEID. Start the tasks with srun (or pass --ntasks-per-node)."
    )


def from_slurm(env: Mapping[str, str]) -> Cluster:
    """The cluster SLURM describes: SLURM_PROCID is the rank, the first host of the step's node list the master."""
    required = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    missing = [name for name in required if name not in env]
    if missing:
        raise ClusterError(
            f"SLURM's variables are only partly set: {', '.join(missing)} missing. "
            f"Received: SLURM_PROCID={show(env.get('SLURM_PROCID'))}. Start the tasks with srun."
        )
    rank, world_size, local_rank = (
        _int(env, "SLURM_PROCID"),
        _int(env, "SLURM_NTASKS", minimum=1),
        _int(env, "SLURM_LOCALID"),
    )
    _check_rank("SLURM_PROCID", rank, "SLURM_NTASKS", world_size)
    local_world_size, local_reason = _slurm_local_world_size(env)
    _check_rank("SLURM_LOCALID", local_rank, "the tasks on this node", local_world_size)
    if "MASTER_ADDR" in env:
        master_addr = _host("MASTER_ADDR", env["MASTER_ADDR"], "MASTER_ADDR")
        addr_reason = f"MASTER_ADDR={master_addr}"
    else:
        name = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if n in env), None)
        if name is None:
            raise ClusterError(
                "Cannot find the master host under SLURM: no SLURM_STEP_NODELIST or SLURM_JOB_NODELIST. "
                f"Received: SLURM_PROCID={show(env['SLURM_PROCID'])}. Start the tasks with srun, or set MASTER_ADDR."
            )
        master_addr = _host(name, first_host(env[name]), f"the first host of {name}")
        addr_reason = f"first host of {name}={env[name][:SHOWN]}"
    master_port, port_reason = slurm_master_port(env)
    return _rank_worker(
        rank,
        world_size,
        local_rank,
        local_world_size,
        master_addr,
        master_port,
        "SLURM",
        (
            f"SLURM_PROCID={rank}, SLURM_NTASKS={world_size}, SLURM_LOCALID={local_rank}",
            f"tasks on this node from {local_reason}",
            f"master host from {addr_reason}",
            f"master port from {port_reason}",
        ),
    )


def _rank_worker(
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    master_addr: str,
    master_port: int,
    source: str,
    evidence: tuple[str, ...],
) -> Cluster:
    """A worker of a job whose launcher numbers its processes (torchrun, SLURM): task index, rank and the chief's
    address all follow from the rank and the master's address."""
    return Cluster(
        task_type="worker",
        task_index=rank,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        chief_address=f"{master_addr}:{master_port}",
        master_addr=master_addr,
        master_port=master_port,
        source=source,
        evidence=evidence,
    )


def single_process() -> Cluster:
    """One process, rank 0 of 1; port 0 lets the rendezvous pick any free port."""
    return Cluster(
        task_type="worker",
        task_index=0,
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        chief_address="127.0.0.1:0",
        master_addr="127.0.0.1",
        master_port=0,
        source="single-process",
        evidence=("no explicit cluster, TF_CONFIG, RANK/WORLD_SIZE or SLURM_PROCID: one process",),
    )


def _agree_with_torchrun(cluster: Cluster, env: Mapping[str, str]) -> None:
    """TF_CONFIG wins over RANK/WORLD_SIZE; if both are set they must describe the same process."""
    if cluster.rank is None or "RANK" not in env or "WORLD_SIZE" not in env:
        return
    if (env["RANK"], env["WORLD_SIZE"]) != (str(cluster.rank), str(cluster.world_size)):
        raise ClusterError(
            f"TF_CONFIG and torchrun's variables disagree. Received: TF_CONFIG gives {cluster.task_name} "
            f"rank {cluster.rank} of {cluster.world_size}, RANK={env['RANK'][:40]}, WORLD_SIZE={env['WORLD_SIZE'][:40]}. "
            "Unset one of them (TF_CONFIG takes precedence), or make them agree."
        )


def _from_tf_config(env: Mapping[str, str]) -> Cluster:
    cluster = parse_tf_config(env["TF_CONFIG"], source="TF_CONFIG")
    _agree_with_torchrun(cluster, env)
    return cluster


@dataclass(frozen=True, kw_only=True)
class ClusterSource:
    """One place a process learns its cluster from: how to tell it is set, and how to read it.

    Example:
        >>> SOURCES[1].name, SOURCES[1].detect({"RANK": "0"})
        ('torchrun', True)
    """

    name: str
    """How the cluster names its source (``Cluster.source``) and how a shadowed source is named."""
    detect: Callable[[Mapping[str, str]], bool]
    """True when the environment sets any of this source's variables, even only some of them: ``parse``
    then refuses a half-set source instead of skipping it."""
    parse: Callable[[Mapping[str, str]], Cluster]
    """The cluster the environment describes; raises ``ClusterError`` naming what is wrong."""


SOURCES: tuple[ClusterSource, ...] = (
    ClusterSource(name="TF_CONFIG", detect=lambda env: bool(env.get("TF_CONFIG", "").strip()), parse=_from_tf_config),
    ClusterSource(name="torchrun", detect=lambda env: "RANK" in env or "WORLD_SIZE" in env, parse=from_torchrun),
    ClusterSource(name="SLURM", detect=lambda env: "SLURM_PROCID" in env, parse=from_slurm),
)
"""Where a cluster is read from, first match wins; a later source also set is noted in the evidence."""


def resolve_cluster(explicit: Cluster | Mapping[str, Any] | None = None, *, env: Mapping[str, str]) -> Cluster:
    """The cluster of this process: ``explicit``, else the first of `SOURCES` set (TF_CONFIG, torchrun,
    SLURM), else one process.

    ``explicit`` is a ``Cluster`` (returned as is) or a dict in TF_CONFIG form. ``env`` is the
    process environment (``stratagem.environ.current()``), passed in so tests can construct one.

    Example:
        >>> c = resolve_cluster(env={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
        ...                          "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
        >>> c.source, c.rank, c.task_name
        ('torchrun', 1, 'worker:1')
    """
    detected = [source for source in SOURCES if source.detect(env)]
    if explicit is not None:
        if isinstance(explicit, Cluster):
            return explicit
        if not isinstance(explicit, Mapping):
            raise ClusterError(
                f"An explicit cluster must be a Cluster or a dict in TF_CONFIG form. "
                f"Received: {type(explicit).__name__} {show(explicit)}. Pass Cluster(...) or "
                '{"cluster": {...}, "task": {"type": ..., "index": ...}}.'
            )
        cluster, shadowed = parse_tf_config(explicit, source="explicit"), detected
    elif detected:
        cluster, shadowed = detected[0].parse(env), detected[1:]
    else:
        return single_process()
    if not shadowed:
        return cluster
    note = f"{cluster.source} takes precedence over {', '.join(source.name for source in shadowed)} (also set)"
    return replace(cluster, evidence=(*cluster.evidence, note))
