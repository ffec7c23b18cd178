"""The ``Cluster`` value: who this process is among the processes of one training job.

Vocabulary follows both peers: ``task_type``/``task_index`` as in TF_CONFIG, ``rank``,
``world_size``, ``local_rank`` as in ``torch.distributed``.

The collective world is the chief and the workers, the tasks that take part in all-reduce.
Parameter servers (``ps``) and the ``evaluator`` are tasks of the job but not members of that
world: for them ``rank`` and ``local_rank`` are ``None`` while ``world_size`` still counts the
collective members, so every task of a job agrees on ``world_size``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stratagem.errors import ClusterError

# Order of task types in a TF_CONFIG and in rank assignment: the chief comes first (rank 0).
TASK_TYPES = ("chief", "worker", "ps", "evaluator")
COLLECTIVE_TASK_TYPES = ("chief", "worker")

# Where a Cluster can come from, in the order resolve_cluster tries them.
SOURCES = ("explicit", "TF_CONFIG", "torchrun", "SLURM", "single-process")

SHOWN = 200
_INT_BOUND = 2**63
"""Characters of a received value that an error quotes: enough to recognise it, never a flood."""


def show(value: Any, limit: int = SHOWN) -> str:
    """``repr`` of a received value for an error message, cut to `limit` characters, and never raising.

    A string is cut before ``repr`` so a huge one costs nothing; a value whose ``repr`` fails
    (nested deeper than Python's recursion limit, an int too long to print) is named by its type.
    """
    if isinstance(value, str) and len(value) > limit:
        return repr(value[:limit]) + f"... ({len(value)} characters)"
    try:
        text = repr(value)
    except RecursionError:
        return f"<a {type(value).__name__} nested too deeply to show>"
    except Exception:  # noqa: BLE001 - e.g. ValueError for an int of more than 4300 digits
        return f"<a {type(value).__name__} too large to show>"
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Who this process is: its task, its rank, and where to meet the others.

    Example:
        >>> cluster = Cluster.from_tf_config({
        ...     "cluster": {"chief": ["10.0.0.1:2222"], "worker": ["10.0.0.2:2222"]},
        ...     "task": {"type": "worker", "index": 0},
        ... })
        >>> cluster.rank, cluster.world_size, cluster.is_chief, cluster.master_port
        (1, 2, False, 2222)
    """

    task_type: str
    """``chief``, ``worker``, ``ps`` or ``evaluator``; torchrun and SLURM processes are all ``worker``."""
    task_index: int
    """Index of this task among the tasks of its type."""
    rank: int | None
    """Rank in the collective world (chief 0, then workers); ``None`` for ``ps`` and ``evaluator``."""
    world_size: int
    """Number of processes in the collective world (chief + workers)."""
    local_rank: int | None
    """Rank among the collective processes on this host; ``None`` for ``ps`` and ``evaluator``."""
    local_world_size: int
    """Number of collective processes on this host."""
    addresses: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """``host:port`` of every task, by task type; empty when the source does not say (torchrun, SLURM)."""
    chief_address: str
    """``host:port`` of the chief (task ``chief``, else worker 0): the rendezvous point."""
    master_addr: str
    """Host of torch.distributed's TCP store (the chief's host)."""
    master_port: int
    """Port of torch.distributed's TCP store (the chief's port)."""
    rpc_layer: str | None = None
    """TF_CONFIG's ``rpc_layer`` (for example ``grpc``), when given."""
    source: str
    """Which source produced this value: one of ``SOURCES``."""
    evidence: tuple[str, ...] = ()
    """The inputs that decided it, one line each (``RANK=1``, ``TF_CONFIG task = worker:0``...)."""

    def __post_init__(self) -> None:
        self._check_types()
        unknown = [kind for kind in self.addresses if kind not in TASK_TYPES]
        checks = [
            (self.source in SOURCES, "Unknown cluster source", f"source={show(self.source)}", f"Use one of {SOURCES}"),
            (
                self.task_type in TASK_TYPES,
                "Unknown task type",
                f"task_type={show(self.task_type)}",
                f"Use one of {TASK_TYPES}",
            ),
            (not unknown, "Unknown task type in addresses", show(unknown), f"Use only {TASK_TYPES}"),
            (
                self.world_size >= 1 and (self.rank is None or 0 <= self.rank < self.world_size),
                "rank must be in 0..world_size-1",
                f"rank={show(self.rank)}, world_size={show(self.world_size)}",
                "Give each of the world_size processes a distinct rank",
            ),
            (
                (self.rank is None) == (self.task_type not in COLLECTIVE_TASK_TYPES),
                "Only the chief and workers have a rank",
                f"task_type={show(self.task_type)}, rank={show(self.rank)}",
                "Set rank=None for ps and evaluator tasks, and a rank for the others",
            ),
            (
                self.local_rank is None or 0 <= self.local_rank < self.local_world_size,
                "local_rank must be in 0..local_world_size-1",
                f"local_rank={show(self.local_rank)}, local_world_size={show(self.local_world_size)}",
                "Count local ranks among the processes of this host",
            ),
            (
                0 <= self.master_port <= 65535,
                "master_port is not a port",
                f"master_port={show(self.master_port)}",
                "Use 1..65535, or 0 to pick a free port (single process only)",
            ),
            (
                self.task_index >= 0,
                "task_index must be >= 0",
                f"task_index={show(self.task_index)}",
                "Number the tasks of each type from 0",
            ),
        ]
        for ok, what, received, fix in checks:
            if not ok:
                raise ClusterError(f"{what}. Received: {received}. {fix}.")
        # Freeze the address lists so a Cluster can be shared between threads without copies.
        frozen = {kind: tuple(self.addresses[kind]) for kind in TASK_TYPES if kind in self.addresses}
        object.__setattr__(self, "addresses", frozen)
        object.__setattr__(self, "evidence", tuple(self.evidence))

    def _check_types(self) -> None:
        """Every field of the type it is documented with, before any comparison could raise TypeError."""

        def fail(name: str, expected: str) -> ClusterError:
            return ClusterError(
                f"Cluster.{name} must be {expected}. Received: {name}={show(getattr(self, name))}. "
                f"Pass {expected} (or build the Cluster with resolve_cluster or from_tf_config)."
            )

        def is_int(value: Any) -> bool:  # bounded, so that every message and rendering can print it
            return isinstance(value, int) and not isinstance(value, bool) and -_INT_BOUND < value < _INT_BOUND

        for name in ("task_index", "world_size", "local_world_size", "master_port"):
            if not is_int(getattr(self, name)):
                raise fail(name, "an int below 2**63")
        for name in ("rank", "local_rank"):
            if getattr(self, name) is not None and not is_int(getattr(self, name)):
                raise fail(name, "an int below 2**63, or None")
        for name in ("task_type", "chief_address", "master_addr", "source"):
            if not isinstance(getattr(self, name), str):
                raise fail(name, "a str")
        if self.rpc_layer is not None and not isinstance(self.rpc_layer, str):
            raise fail("rpc_layer", "a str or None")
        if not isinstance(self.addresses, Mapping) or not all(
            isinstance(addrs, (list, tuple)) and all(isinstance(a, str) for a in addrs)
            for addrs in self.addresses.values()
        ):
            raise fail("addresses", 'a dict of "host:port" lists by task type')
        if not isinstance(self.evidence, (list, tuple)) or not all(isinstance(line, str) for line in self.evidence):
            raise fail("evidence", "a tuple of str")

    # -- derived facts ---------------------------------------------------------------------

    @property
    def task_name(self) -> str:
        """``type:index``, the name used in logs and errors (``worker:1``)."""
        return f"{self.task_type}:{self.task_index}"

    @property
    def num_workers(self) -> int:
        """Number of processes taking part in collectives (chief + workers), as in tf.distribute."""
        return self.world_size

    @property
    def is_chief(self) -> bool:
        """True for rank 0: the task that writes checkpoints and hosts the rendezvous."""
        return self.rank == 0

    @property
    def in_collective(self) -> bool:
        """True for the chief and workers; False for parameter servers and the evaluator."""
        return self.rank is not None

    @property
    def is_distributed(self) -> bool:
        """True when more than one process takes part in the job."""
        return self.world_size > 1 or any(self.addresses.get(kind) for kind in ("ps", "evaluator"))

    def task_for_rank(self, rank: int) -> str:
        """The task name of ``rank`` (``chief:0``, ``worker:2``) for errors that name who is missing."""
        if not 0 <= rank < self.world_size:
            raise ClusterError(
                f"Rank out of range. Received: rank={rank}, world_size={self.world_size}. "
                f"Use a rank in 0..{self.world_size - 1}."
            )
        num_chiefs = len(self.addresses.get("chief", ()))
        if rank < num_chiefs:
            return f"chief:{rank}"
        return f"worker:{rank - num_chiefs}"

    # -- renderings ------------------------------------------------------------------------

    def to_tf_config(self) -> dict[str, Any]:
        """This cluster in TF_CONFIG form (``json.dumps`` it to export ``TF_CONFIG``).

        Raises ``ClusterError`` when the source did not give every task's address
        (torchrun and SLURM name only the master).
        """
        if not self.addresses:
            raise ClusterError(
                f"This cluster has no per-task addresses, so it cannot be written as TF_CONFIG. "
                f"Received: a cluster from {self.source} ({self.task_name}, world_size={self.world_size}). "
                "Describe the cluster with TF_CONFIG or an explicit dict instead."
            )
        config: dict[str, Any] = {
            "cluster": {kind: list(addrs) for kind, addrs in self.addresses.items()},
            "task": {"type": self.task_type, "index": self.task_index},
        }
        if self.rpc_layer is not None:
            config["rpc_layer"] = self.rpc_layer
        return config

    def as_dict(self) -> dict[str, Any]:
        """Every field and derived fact as JSON-ready data (the JSON rendering of ``explain``)."""
        return {
            "source": self.source,
            "task": self.task_name,
            "task_type": self.task_type,
            "task_index": self.task_index,
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "local_world_size": self.local_world_size,
            "num_workers": self.num_workers,
            "is_chief": self.is_chief,
            "chief_address": self.chief_address,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "rpc_layer": self.rpc_layer,
            "addresses": {kind: list(addrs) for kind, addrs in self.addresses.items()},
            "evidence": list(self.evidence),
        }

    def explain(self) -> str:
        """A few lines saying who this process is and which inputs decided it."""
        role = "chief" if self.is_chief else ("not in the collective world" if self.rank is None else "member")
        lines = [
            f"cluster from {self.source}: task {self.task_name}, rank {self.rank} of {self.world_size} ({role})",
            f"  local rank {self.local_rank} of {self.local_world_size} on this host",
            f"  rendezvous at {self.master_addr}:{self.master_port} (chief {self.chief_address})",
        ]
        for kind, addrs in self.addresses.items():
            lines.append(f"  {kind}: {', '.join(addrs)}")
        lines.extend(f"  because {line}" for line in self.evidence)
        return "\n".join(lines)

    def to_json(self) -> str:
        """``as_dict`` as a JSON string."""
        return json.dumps(self.as_dict(), indent=2)

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_tf_config(cls, config: Mapping[str, Any] | str, *, source: str = "explicit") -> Cluster:
        """Parse a TF_CONFIG (a dict, or its JSON text); see ``stratagem.cluster.tf_config``."""
        from stratagem.cluster.tf_config import parse_tf_config

        return parse_tf_config(config, source=source)
