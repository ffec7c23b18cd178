"""A process's place in a job: one value, checked before anything is built, then started once.

A strategy that runs one process per worker (MultiWorkerMirrored, the sharded one) needs the same
facts and the same start-up: the cluster, this process's rank and every task's name, the timeout;
then its local devices, the backend, the default process group formed through the rendezvous, the
bounded collectives with their watchdog (`collective.cross_worker.CrossWorker`), the check that the
workers agree on their devices, and a close that frees the group and hands the rendezvous store back.
They live here, in that order:

1. `plan_worker_group` resolves the cluster and refuses what cannot start (a task without a rank, a
   timeout outside `stratagem.timeouts`' range, a mesh whose product is not the worker count) before any
   device is chosen or port opened, as torchtitan's `ParallelDims` checks its degrees before a mesh exists;
   the plan carries the mesh's named degrees (`cluster.mesh.DeviceMesh`; one `data` axis by default);
2. the strategy chooses its local devices (they may depend on the plan's local rank);
3. `WorkerGroup.start` forms the process group and returns the value its parts are handed; its
   `device_mesh()` is torch's DeviceMesh of the plan's shape and axis names.

Example:
    >>> from stratagem import environ
    >>> env = environ.current()
    >>> plan = plan_worker_group(None, timeout=60, env=env)                       # doctest: +SKIP
    >>> group = WorkerGroup.start(plan, [torch.device("cpu")], env=env)           # doctest: +SKIP
    >>> group.rank, group.world_size, group.task_names                           # doctest: +SKIP
    (0, 2, ('worker:0', 'worker:1'))
    >>> mesh = group.device_mesh()                                                # doctest: +SKIP
    >>> mesh.mesh_dim_names                                                       # doctest: +SKIP
    ('data',)
    >>> group.close()                                                             # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import socket
import sys
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from stratagem import environ
from stratagem.cluster.mesh import DeviceMesh, one_axis_mesh
from stratagem.cluster.release import release_store
from stratagem.cluster.rendezvous import Rendezvous, agent_store_prefix, join_process_group
from stratagem.cluster.resolve import resolve_cluster
from stratagem.cluster.spec import Cluster
from stratagem.collective.cross_worker import ROLL_CALL_SECONDS, CrossWorker
from stratagem.diagnose import PlacementDecision
from stratagem.errors import ClusterError, InputError
from stratagem.timeouts import check_seconds

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

Environ = Mapping[str, str]
"""The process environment as the caller read it (`stratagem.environ.current()`)."""

NCCL_TIMEOUT_MARGIN_S = 30.0
"""How much longer than stratagem's own deadline and roll call torch's NCCL watchdog waits for a collective.

torch's NCCL watchdog ends a collective at the process group's timeout (by default tearing the
process down with its own message); stratagem's watchdog must come first, so that the error names
who is missing. Its clock starts when the host hands a collective over, which can be the rest of a
backward pass after torch's starts (a bucket queued early); the margin covers that, the roll call's
store calls and the stall warning's read of the steps reached, with room to spare."""


@dataclass(frozen=True, kw_only=True)
class WorkerGroupPlan:
    """Who this process is in the job, checked before anything is built. Made by `plan_worker_group`.

    Example:
        >>> plan = plan_worker_group(
        ...     {"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, "task": {"type": "worker", "index": 1}},
        ...     timeout=60,
        ...     env={},
        ... )
        >>> plan.rank, plan.world_size, plan.task_names, plan.is_chief
        (1, 2, ('worker:0', 'worker:1'), False)
        >>> plan.mesh
        DeviceMesh(shape=(2,), axis_names=('data',))
    """

    cluster: Cluster
    """The resolved cluster (explicit, TF_CONFIG, torchrun, SLURM or one process)."""
    rank: int
    """This process's rank in the collective world (the chief is 0)."""
    world_size: int
    """The number of processes in the collective world."""
    task_names: tuple[str, ...]
    """Every rank's task name, in rank order (``worker:0``, ...): what errors name."""
    timeout: float
    """Seconds any wait (rendezvous, collective) may last before an error naming who is missing."""
    mesh: DeviceMesh
    """The workers' named degrees, their product the world size: the shape and axis names of
    `WorkerGroup.device_mesh()` (one `data` axis over every worker unless the strategy gave another)."""

    @property
    def is_chief(self) -> bool:
        """True on rank 0, the worker that writes checkpoints and reports."""
        return self.rank == 0


def plan_worker_group(
    cluster: Cluster | Mapping[str, Any] | None,
    *,
    timeout: float,
    env: Environ,
    mesh: DeviceMesh | None = None,
    default_axis: str = "data",
) -> WorkerGroupPlan:
    """Resolves this process's cluster and checks that it can join a worker group; builds nothing.

    `mesh`: the workers' named degrees (`DeviceMesh`), whose product must be the worker count; None: one axis
    named `default_axis` over every worker.

    Raises `InputError` for a timeout outside `stratagem.timeouts`' range or a mesh whose product is not the
    worker count (naming both), and `ClusterError` for a cluster that cannot be resolved or a task that is no
    member of the collective world (``ps``, ``evaluator``).
    """
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise InputError(
            f"A worker group's mesh is a stratagem DeviceMesh. Received: {type(mesh).__name__}. "
            "Give sg.DeviceMesh(shape, axis_names), or None for one axis over every worker."
        )
    seconds = check_seconds("timeout", timeout)
    resolved = resolve_cluster(cluster, env=env)
    if resolved.rank is None:
        raise ClusterError(
            f"Task {resolved.task_name} is not a member of the collective world, so it has no rank in a worker "
            f"group. Received: task_type={resolved.task_type!r}. Only the chief and workers run this strategy; "
            "start parameter servers and the evaluator with ParameterServerStrategy or their own scripts."
        )
    if mesh is None:
        mesh = one_axis_mesh(resolved.world_size, default_axis)
    mesh.check_workers(resolved.world_size)  # before any process group: a wrong product fails here, alone
    return WorkerGroupPlan(
        cluster=resolved,
        rank=resolved.rank,
        world_size=resolved.world_size,
        task_names=tuple(resolved.task_for_rank(r) for r in range(resolved.world_size)),
        timeout=seconds,
        mesh=mesh,
    )


def choose_backend(devices: Sequence[torch.device]) -> tuple[str, str]:
    """NCCL when every local device is a GPU and torch has it, else Gloo; with the reason."""
    if devices and all(d.type == "cuda" for d in devices) and dist.is_nccl_available():
        return "nccl", "every local replica is on a GPU and torch has NCCL"
    if devices and all(d.type == "cuda" for d in devices):
        return "gloo", "torch was built without NCCL, so GPU gradients cross workers through Gloo (slower)"
    return "gloo", "the replicas are on the CPU, where torch.distributed uses Gloo"


def process_group_timeout(backend: str, timeout: float) -> float:
    """The process group's own timeout: under NCCL the group's timeout plus two roll calls (the call and
    the read of the steps reached after it) plus `NCCL_TIMEOUT_MARGIN_S`; under Gloo the group's timeout,
    which the host path's own waits come before anyway (it polls, then waits on finished work only)."""
    if backend == "nccl":
        return timeout + 2 * ROLL_CALL_SECONDS + NCCL_TIMEOUT_MARGIN_S
    return timeout


def start_process_group(
    cluster: Cluster,
    devices: Sequence[torch.device],
    backend: str,
    timeout: float,
    *,
    token: str | None,
    agent_store: str | None = None,
) -> Rendezvous:
    """Binds this process to its first GPU, then forms the process group with that device; returns the store
    and, on the chief, its server apart (`Rendezvous`).

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
    return join_process_group(
        cluster,
        backend,
        timeout,
        token=token,
        device_id=device_id,
        agent_store=agent_store,
        group_timeout=process_group_timeout(backend, timeout),
    )


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


class WorkerGroup:
    """This process's place in a running job: the plan, its local devices, the process group and the
    bounded collectives over it. Made by `WorkerGroup.start`; closed by `close` (or at exit)."""

    def __init__(
        self,
        plan: WorkerGroupPlan,
        local_devices: Sequence[torch.device],
        *,
        backend: str,
        backend_reason: str,
        rendezvous: Rendezvous,
        store_owned: bool,
        cross_worker: CrossWorker,
    ) -> None:
        """Use `WorkerGroup.start`: this only holds what it made."""
        self.plan = plan
        self.local_devices = list(local_devices)
        self.backend = backend
        self.cross_worker = cross_worker
        self._backend_reason = backend_reason
        self._store: Any = rendezvous.store
        # The chief's listening store, held here only: the process group (which FSDP2 and DTensor keep alive)
        # holds a client, so close() frees the port by dropping this.
        self._server = rendezvous.server
        # torchrun's agent owns its store, so nobody's leaving can free it: close() must not wait for that.
        self._store_owned = store_owned
        self._mesh: TorchDeviceMesh | None = None
        self._closed = False

    @classmethod
    def start(cls, plan: WorkerGroupPlan, local_devices: Sequence[torch.device], *, env: Environ) -> WorkerGroup:
        """Forms the default process group for `plan` with this worker's `local_devices`, and checks that
        every worker holds as many local devices and that no two workers of one machine share a GPU.

        Raises `CollectiveTimeoutError` naming the ranks that never came, `ClusterError` for a rendezvous
        that cannot happen (a token that differs, a port in use), `InputError` when the workers' devices
        disagree (the process group is then freed again).
        """
        cluster = plan.cluster
        devices = [torch.device(d) for d in local_devices]
        backend, why = choose_backend(devices)
        if cluster.master_addr in ("127.0.0.1", "localhost"):
            # Gloo otherwise binds the address the host name resolves to; a local cluster stays on loopback.
            environ.set_default("GLOO_SOCKET_IFNAME", "lo")
        agent_store = agent_store_prefix(cluster, env)
        met = start_process_group(
            cluster, devices, backend, plan.timeout, token=env.get("STRATAGEM_CLUSTER_TOKEN"), agent_store=agent_store
        )
        cross_worker = CrossWorker(
            met.store,
            rank=plan.rank,
            task_names=plan.task_names,
            timeout=plan.timeout,
            device_collectives=backend == "nccl",  # the host does not wait for GPU collectives: a watchdog does
        )
        group = cls(
            plan,
            devices,
            backend=backend,
            backend_reason=why,
            rendezvous=met,
            store_owned=agent_store is None,
            cross_worker=cross_worker,
        )
        # A script that never calls close() still frees the process group while Python is alive (see close).
        atexit.register(_close_at_exit, weakref.ref(group))
        try:
            group._check_same_local_devices(env.get("CUDA_VISIBLE_DEVICES"))
        except BaseException:
            group.close(release=False)
            raise
        return group

    # ---- the plan's facts ------------------------------------------------------------------------
    @property
    def cluster(self) -> Cluster:
        return self.plan.cluster

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def task_names(self) -> tuple[str, ...]:
        return self.plan.task_names

    @property
    def task_name(self) -> str:
        """This process's task (``worker:1``)."""
        return self.plan.task_names[self.plan.rank]

    @property
    def is_chief(self) -> bool:
        return self.plan.is_chief

    @property
    def timeout(self) -> float:
        return self.plan.timeout

    @property
    def collective_device(self) -> torch.device:
        """Where a tensor handed to a collective of this group must be: the first local GPU under NCCL, else the CPU."""
        return self.local_devices[0] if self.backend == "nccl" else torch.device("cpu")

    # ---- start-up check --------------------------------------------------------------------------
    def _check_same_local_devices(self, cuda_visible_devices: str | None) -> None:
        mine = (
            len(self.local_devices),
            socket.gethostname(),
            cuda_visible_devices,
            sorted({d.index for d in self.local_devices if d.type == "cuda"}),
        )
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        counts = [g[0] for g in gathered]
        if len(set(counts)) != 1:
            detail = ", ".join(f"{self.task_names[r]}: {c}" for r, c in enumerate(counts))
            raise InputError(
                f"Every worker must hold the same number of local replicas. Received: {detail}. "
                "Give every worker the same devices= (stratagem launch --devices-per-worker K)."
            )
        shared = ranks_sharing_a_gpu([(g[1], g[2], g[3]) for g in gathered])
        if shared is not None:
            (a, b), gpu = shared
            raise InputError(
                f"Two workers on one machine use the same GPU: {self.task_names[a]} (rank {a}) and "
                f"{self.task_names[b]} (rank {b}) both hold cuda:{gpu}. Received: devices "
                f"{[str(d) for d in self.local_devices]} on this worker. Leave devices= unset (one GPU per local "
                "rank), or give each worker on a machine its own GPUs."
            )

    # ---- what others build on it -----------------------------------------------------------------
    def device_mesh(self) -> TorchDeviceMesh:
        """torch's `DeviceMesh` of the plan's mesh (its shape and axis names; one `data` axis over every rank by
        default), made once on the default process group, for torch's own distributed modules (FSDP2, DTensor,
        distributed checkpoints)."""
        if self._closed:
            raise InputError(
                f"The worker group of {self.task_name} is closed, so it has no device mesh. Received: a call to "
                "device_mesh() after close(). Make the mesh before closing the strategy."
            )
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = self.plan.mesh
            self._mesh = init_device_mesh(self.collective_device.type, mesh.shape, mesh_dim_names=mesh.axis_names)
        return self._mesh

    def decisions(self) -> list[PlacementDecision]:
        return [PlacementDecision(subject="cross-worker backend", choice=self.backend, reason=self._backend_reason)]

    def close(self, *, release: bool = True) -> None:
        """Stops the collectives' watchdog and shared memory and frees the process group, whose Gloo threads
        then end; a second call does nothing. Runs by itself at exit: a Gloo thread still running when the
        interpreter shuts down aborts the process if it releases a finished collective then (SIGABRT after
        a successful run). `release`: hand the rendezvous store back (see cluster/release.py), so that a
        group can start again at the same address; not needed at exit, where a worker that already died
        would only delay it."""
        if self._closed:
            return  # closed already: the process group now may be another group's
        self._closed = True
        self._mesh = None
        cw = self.cross_worker
        cw.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        store, self._store, cw.store = self._store, None, None
        # Closing while an exception propagates (a `finally:` after a worker died): the others may never say
        # they are done, so the handshake would only hold this one up for `timeout`; the server just goes.
        if release and store is not None and sys.exc_info()[0] is None:
            release_store(
                store, rank=self.rank, task_names=self.task_names, timeout=self.timeout, owned=self._store_owned
            )
        # The chief's server stops listening with its last reference, this one: the process group, which torch's
        # modules may keep, holds only a client, which never writes again.
        self._server = None

    @property
    def closed(self) -> bool:
        return self._closed


def _close_at_exit(ref: weakref.ref[WorkerGroup]) -> None:
    group = ref()
    if group is not None:
        group.close(release=False)
