"""Rendezvous: the ranks of a ``Cluster`` meet at the chief's TCP store, then form a process group.

torch.distributed's own rendezvous, on timeout, says only that it timed out. Before handing the
store to it, every rank records its arrival under ``stratagem/arrived/<rank>``; if the wait runs
out, the keys that exist say exactly which ranks (and so which tasks) never came. At a quarter of
the timeout a warning names the ranks not yet there (or the chief's address, while it cannot be
reached).

Before it arrives, a rank claims its task index in the store (an atomic ``compare_set`` of
``stratagem/claim/<rank>``): a second process started with a task that is taken, at the start or in
the middle of training, is refused at once with an error naming the task, its address and the
process that holds it, and never touches the running job's keys or its process group.

The meeting (connecting to the store, claiming, arriving, waiting for the others, checking tokens) runs in
a helper thread that the caller waits for at most the timeout: torch's TCPStore can wait far
longer inside (its handshake with a port that accepts but never answers waits until the peer
closes), and the user's timeout is the promise.

The chief serves the store and, for a worker group (`join_process_group`), joins it as a client like
every other rank: the process group holds only clients, so the port closes when the group's owner drops
the server, even while torch's modules (FSDP2, DTensor) keep the process group alive.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from stratagem.cluster.spec import Cluster
from stratagem.errors import ClusterError, CollectiveTimeoutError, RendezvousError
from stratagem.timeouts import check_seconds

logger = logging.getLogger(__name__)

_ARRIVED = "stratagem/arrived/{rank}"
_TOKEN = "stratagem/token/{rank}"
_CHECKED = "stratagem/checked/{rank}"
_CLAIM = "stratagem/claim/{rank}"


@functools.lru_cache(maxsize=None)
def _claimant(pid: int) -> str:
    """Who process ``pid`` (this one) is, as its claim of a task index reads: a second process claiming the same
    index is told who holds it; the random part tells this process from a namesake (same host, a reused pid).
    Keyed by pid, so that a forked child is not taken for its parent."""
    return f"{socket.gethostname()} pid {pid} #{secrets.token_hex(4)}"


def _as_timedelta(timeout: float | timedelta, name: str = "timeout") -> timedelta:
    return timedelta(seconds=check_seconds(name, timeout, error=ClusterError))


def _token_digest(token: str | None) -> str:
    # Only a digest travels through the (unauthenticated) store, never the token itself.
    return hashlib.sha256(token.encode()).hexdigest()[:16] if token else "-"


@dataclass(frozen=True, eq=False)
class Rendezvous:
    """What a rank takes away from the meeting (`join_process_group`).

    ``store`` is what every rank reads and writes, and what the process group holds: on every rank, the
    chief's included, a client of the chief's store. ``server`` is, on the chief, the store that listens at
    the cluster's address (None on the other ranks and under torchrun's agent, whose store it is).

    They are apart because torch's modules keep the process group, and with it its store, alive as long as
    they live (FSDP2's module state, a DTensor's mesh): a server in the group's hands would hold the chief's
    port until the user's model is gone. Dropping ``server`` closes the port however long the group lives.
    """

    store: dist.Store
    server: dist.TCPStore | None = None


def _connect(cluster: Cluster, rank: int, timeout: timedelta, agent_store: str | None, apart: bool) -> Rendezvous:
    """Connects to the chief's store (the chief serves it first); ``apart``: the chief then joins its own store
    as a client, like every other rank (see `Rendezvous`)."""
    where = f"{cluster.master_addr}:{cluster.master_port}"
    try:
        if agent_store is not None:
            # torchrun's agent already serves a store at MASTER_PORT: a second server there fails to bind
            # (and c10d logs it), so every rank, the chief included, joins the agent's as a client, under a
            # prefix of its own per restart so an earlier attempt's keys cannot count as arrivals.
            client = dist.TCPStore(
                cluster.master_addr, cluster.master_port, cluster.world_size, is_master=False, timeout=timeout
            )
            return Rendezvous(dist.PrefixStore(agent_store, client))
        store = dist.TCPStore(
            cluster.master_addr,
            cluster.master_port,
            cluster.world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
    except dist.DistNetworkError as exc:
        if rank == 0:
            holder = _chief_holder(cluster, timeout)
            if holder is not None:
                raise _duplicate(cluster, rank, holder) from exc
            raise ClusterError(
                f"The chief ({cluster.task_name}) cannot listen at {where}: {str(exc).splitlines()[0]} "
                f"Received: master_addr={cluster.master_addr!r}, master_port={cluster.master_port}. "
                "Choose a free port for the chief (another process may hold this one)."
            ) from exc
        raise _unreachable(cluster, rank, timeout) from exc
    if rank != 0 or not apart:
        return Rendezvous(store, store if rank == 0 else None)
    try:
        # The server's own port: a cluster of one process may give port 0 (any free port).
        client = dist.TCPStore(cluster.master_addr, store.port, is_master=False, timeout=timeout)
    except dist.DistNetworkError as exc:
        raise ClusterError(
            f"The chief ({cluster.task_name}) listens at {where} but cannot connect to its own store there: "
            f"{str(exc).splitlines()[0]} Received: master_addr={cluster.master_addr!r}. Give the chief an "
            "address that reaches this machine from itself too (its host name or IP address)."
        ) from exc
    return Rendezvous(client, store)


def _claim(store: dist.Store, cluster: Cluster, rank: int) -> None:
    """Takes task index ``rank`` in the store, or raises naming its holder. ``compare_set`` is atomic in the
    store's server, so of two processes claiming one index (at the start, or one arriving mid-training)
    exactly one wins, and the other is refused at once, before it arrives: the running job never sees it."""
    me = _claimant(os.getpid())
    holder = store.compare_set(_CLAIM.format(rank=rank), "", me).decode()
    if holder != me:
        raise _duplicate(cluster, rank, holder)


HOLDER_READ_SECONDS = 5.0
"""At most this long (or a quarter of the timeout, if shorter: the meeting's own error must come within the
timeout), a chief that cannot listen asks the store there who holds it."""


def _chief_holder(cluster: Cluster, timeout: timedelta) -> str | None:
    """Who holds the chief's task at its address, as the claim in the store there reads; None when nothing
    answers there, or something that is not a job's store (another program on the port).

    Read in a daemon thread waited for at most ``HOLDER_READ_SECONDS``: torch's client handshake with a port
    that accepts but never answers waits until the peer closes."""
    if not _accepts(cluster.master_addr, cluster.master_port):
        return None
    seconds = min(HOLDER_READ_SECONDS, timeout.total_seconds() * STALL_FRACTION)
    found: list[str] = []

    def read() -> None:
        try:
            client = dist.TCPStore(
                cluster.master_addr, cluster.master_port, is_master=False, timeout=timedelta(seconds=seconds)
            )
            key = _CLAIM.format(rank=0)
            # A chief that started at the same moment may have bound the port but not claimed yet.
            client.wait([key], timedelta(seconds=seconds))
            found.append(client.get(key).decode())
        except Exception:  # noqa: BLE001 - not a job's store, or gone: the caller says the port is taken
            pass

    thread = threading.Thread(target=read, daemon=True, name="stratagem-rendezvous-holder")
    thread.start()
    thread.join(seconds)
    return found[0] if found else None


def _duplicate(cluster: Cluster, rank: int, holder: str) -> ClusterError:
    where = f"{cluster.master_addr}:{cluster.master_port}"
    listed = cluster.addresses.get(cluster.task_type, ())
    address = f", address {listed[cluster.task_index]}" if cluster.task_index < len(listed) else ""
    if holder == _claimant(os.getpid()):
        return ClusterError(
            f"Task {cluster.task_name} (rank {rank}{address}) of the job meeting at {where} is still held by this "
            "very process: an earlier rendezvous here kept the chief's store. Received: a second claim of "
            f"{cluster.task_name} from the same process. Close the earlier strategy (strategy.close()) before "
            "building another at this address, or give the new one another address."
        )
    return ClusterError(
        f"Task {cluster.task_name} (rank {rank}{address}) of the job meeting at {where} is already held by "
        "another process "
        f"({holder.split(' #')[0]}). Received: a second claim of {cluster.task_name} from this process "
        f"({_claimant(os.getpid()).split(' #')[0]}). Stop the duplicate, or give this process a free task index in TF_CONFIG "
        "(each task of a job runs once)."
    )


def _unreachable(cluster: Cluster, rank: int, timeout: timedelta) -> CollectiveTimeoutError:
    return CollectiveTimeoutError(
        f"Rank {rank} ({cluster.task_name}) could not reach the chief (rank 0, {cluster.task_for_rank(0)}) "
        f"at {cluster.master_addr}:{cluster.master_port} within {timeout.total_seconds():g} s. Missing: rank 0 "
        f"({cluster.task_for_rank(0)}). Start the chief, check that it listens at that address and port, or "
        "raise the timeout."
    )


def _accepts(host: str, port: int) -> bool:
    """Whether something listens at ``host:port`` (a plain TCP connection, closed at once)."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _lost_chief(cluster: Cluster, rank: int, exc: Exception) -> RendezvousError:
    return RendezvousError(
        f"Rank {rank} ({cluster.task_name}) lost the connection to the chief (rank 0, "
        f"{cluster.task_for_rank(0)}) at {cluster.master_addr}:{cluster.master_port} during the rendezvous. "
        f"Received: {str(exc).splitlines()[0]} The chief probably exited; read its log for the cause."
    )


STALL_FRACTION = 0.25
"""The stall warning comes at this fraction of the timeout, as for collectives."""
GRACE_SECONDS = 0.5
"""Past the timeout, how long the caller gives the meeting to report its own (more precise) error."""


def _missing(store: dist.Store, cluster: Cluster, keys: list[str]) -> tuple[list[int], str]:
    missing = [r for r, key in enumerate(keys) if not store.check([key])]
    return missing, ", ".join(f"rank {r} ({cluster.task_for_rank(r)})" for r in missing)


def _wait_for_all(
    store: dist.Store, cluster: Cluster, rank: int, timeout: timedelta, deadline: float, warn_at: float
) -> None:
    keys = [_ARRIVED.format(rank=r) for r in range(cluster.world_size)]
    try:
        if time.monotonic() < warn_at:
            try:
                store.wait(keys, timedelta(seconds=max(0.001, warn_at - time.monotonic())))
                return
            except dist.DistStoreError:
                _, names = _missing(store, cluster, keys)
                logger.warning(
                    "%s (rank %d) has waited %.0f s of %g s at the rendezvous at %s:%d; not arrived yet: %s",
                    cluster.task_name,
                    rank,
                    timeout.total_seconds() * STALL_FRACTION,
                    timeout.total_seconds(),
                    cluster.master_addr,
                    cluster.master_port,
                    names or "none (all arriving now)",
                )
        store.wait(keys, timedelta(seconds=max(0.001, deadline - time.monotonic())))
    except dist.DistStoreError as exc:
        missing, names = _missing(store, cluster, keys)
        raise CollectiveTimeoutError(
            f"Rendezvous at {cluster.master_addr}:{cluster.master_port} timed out after "
            f"{timeout.total_seconds():g} s on rank {rank} ({cluster.task_name}): "
            f"{len(missing)} of {cluster.world_size} ranks did not arrive. Missing: {names}. "
            "Start the missing tasks (check their logs for an earlier crash), or raise the timeout."
        ) from exc
    except dist.DistNetworkError as exc:
        raise _lost_chief(cluster, rank, exc) from exc


class _Meeting:
    """The steps of the meeting, run in a helper thread; ``phase`` says how far it got (for the errors)."""

    def __init__(self, steps: Callable[["_Meeting"], dist.Store]) -> None:
        self.phase = "connecting"
        self.done = threading.Event()
        self.result: dist.Store | None = None
        self.error: BaseException | None = None
        self._steps = steps

    def run(self) -> None:
        try:
            self.result = self._steps(self)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller, which raises it
            self.error = exc
        finally:
            self.done.set()


def _bounded_meeting(
    cluster: Cluster, rank: int, timeout: timedelta, steps: Callable[[_Meeting], Any], start: float
) -> Any:
    """Runs ``steps`` in a daemon thread and waits for it at most the timeout (plus ``GRACE_SECONDS`` for it to
    give its own error); a meeting still stuck inside torch then is left behind, and the error names where."""
    meeting = _Meeting(steps)
    threading.Thread(target=meeting.run, daemon=True, name=f"stratagem-rendezvous-{rank}").start()
    seconds = timeout.total_seconds()
    where = f"{cluster.master_addr}:{cluster.master_port}"
    if not meeting.done.wait(seconds * STALL_FRACTION) and meeting.phase == "connecting":
        logger.warning(
            "%s (rank %d) has waited %.0f s of %g s for the chief (rank 0, %s) at %s; not reached yet",
            cluster.task_name,
            rank,
            seconds * STALL_FRACTION,
            seconds,
            cluster.task_for_rank(0),
            where,
        )
    if not meeting.done.wait(max(0.0, start + seconds + GRACE_SECONDS - time.monotonic())):
        if meeting.phase == "connecting" and _accepts(cluster.master_addr, cluster.master_port):
            raise CollectiveTimeoutError(
                f"Rank {rank} ({cluster.task_name}) could not meet the chief (rank 0, {cluster.task_for_rank(0)}) at "
                f"{where} within {seconds:g} s: the address accepts connections but its store never answered. "
                f"Missing: rank 0 ({cluster.task_for_rank(0)}). Check that the chief runs (not stopped) and "
                f"that {where} is its port, not another program's, or raise the timeout."
            )
        if meeting.phase == "connecting":
            raise _unreachable(cluster, rank, timeout)
        raise CollectiveTimeoutError(
            f"Rendezvous at {where} timed out after {seconds:g} s on rank {rank} ({cluster.task_name}): the chief's "
            f"store (rank 0, {cluster.task_for_rank(0)}) stopped answering while {meeting.phase}. Missing: rank 0 "
            f"({cluster.task_for_rank(0)}). Check that the chief runs (not stopped, not overloaded), or raise the "
            "timeout."
        )
    if meeting.error is not None:
        raise meeting.error
    return meeting.result


def _check_tokens(store: dist.Store, cluster: Cluster, rank: int, timeout: timedelta) -> None:
    """Every rank checks every token, so all of them fail at once rather than hang in init."""
    try:
        digests = [d.decode() for d in store.multi_get([_TOKEN.format(rank=r) for r in range(cluster.world_size)])]
        store.set(_CHECKED.format(rank=rank), "1")
    except dist.DistNetworkError as exc:
        raise _lost_chief(cluster, rank, exc) from exc
    strangers = [r for r, digest in enumerate(digests) if digest != digests[0]]
    if not strangers:
        return
    if rank == 0:
        # The store lives in the chief: keep it up until every rank has read the tokens,
        # so each of them reports the mismatch instead of a lost connection.
        try:
            store.wait([_CHECKED.format(rank=r) for r in range(cluster.world_size)], timeout)
        except dist.DistStoreError:
            pass  # a rank that has gone quiet will time out on its own
    names = ", ".join(f"rank {r} ({cluster.task_for_rank(r)})" for r in strangers)
    raise ClusterError(
        f"Ranks with a different cluster token from the chief's joined the rendezvous at "
        f"{cluster.master_addr}:{cluster.master_port}: {names}. Received: token digests {digests}. "
        "A process from another launch is using this address; stop it, or give every task "
        "the same STRATAGEM_CLUSTER_TOKEN."
    )


def init_process_group(
    cluster: Cluster,
    backend: str = "gloo",
    timeout: float | timedelta = 300.0,
    *,
    token: str | None = None,
    device_id: torch.device | None = None,
    agent_store: str | None = None,
    group_timeout: float | timedelta | None = None,
) -> dist.Store:
    """Meet every rank of ``cluster`` at the chief's TCP store and initialize torch.distributed.

        Raises ``CollectiveTimeoutError`` naming the ranks and tasks that did not arrive within
        ``timeout``, ``RendezvousError`` when the chief goes away meanwhile, and ``ClusterError`` when this task has no rank (``ps``, ``evaluator``), the
        backend is not built into torch, or ``token`` (``STRATAGEM_CLUSTER_TOKEN``) differs from
        the chief's. Returns the store, which stays usable for later coordination. ``device_id`` (a CUDA
    device, for NCCL) is handed to ``torch.distributed.init_process_group``: the communicator forms at
    once on that GPU; set it as the current device first (``torch.cuda.set_device``). ``agent_store`` (a key prefix, see
    `agent_store_prefix`) makes every rank a client of the store torchrun's agent serves at the chief's
    address, instead of the chief serving a second one on the same port. ``group_timeout`` (default: ``timeout``)
    is the process group's own timeout, after which torch ends a collective (for NCCL: its watchdog aborts
    the communicator).

        Example:
            >>> cluster = resolve_cluster(env=environ.current())          # doctest: +SKIP
            >>> store = init_process_group(cluster, "gloo", timeout=60)   # doctest: +SKIP
            >>> torch.distributed.all_reduce(torch.ones(1))               # doctest: +SKIP
    """
    return join_process_group(
        cluster,
        backend,
        timeout,
        token=token,
        device_id=device_id,
        agent_store=agent_store,
        group_timeout=group_timeout,
        apart=False,
    ).store


def join_process_group(
    cluster: Cluster,
    backend: str = "gloo",
    timeout: float | timedelta = 300.0,
    *,
    token: str | None = None,
    device_id: torch.device | None = None,
    agent_store: str | None = None,
    group_timeout: float | timedelta | None = None,
    apart: bool = True,
) -> Rendezvous:
    """As `init_process_group`, but returns the chief's server apart from the store the process group holds
    (``apart``, see `Rendezvous`): the caller owns the server and frees the port by dropping it, while torch's
    modules may keep the group. With ``apart=False`` the chief's server is that store, as
    `init_process_group` hands it back."""
    rank = cluster.rank
    if rank is None:
        raise ClusterError(
            f"Task {cluster.task_name} is not a member of the collective world, so it has no rank to "
            f"join with. Received: task_type={cluster.task_type!r}. Only the chief and workers call "
            "init_process_group; parameter servers and the evaluator serve over gRPC instead."
        )
    if not dist.is_available() or not dist.is_backend_available(backend):
        raise ClusterError(
            f"torch.distributed backend {backend!r} is not available in this torch build. "
            f"Received: backend={backend!r}, torch built with gloo={dist.is_gloo_available()}, "
            f"nccl={dist.is_nccl_available()}. Use 'gloo' on CPU, 'nccl' with a CUDA build of torch."
        )
    if dist.is_initialized():
        raise ClusterError(
            f"torch.distributed is already initialized in this process (rank {dist.get_rank()} of "
            f"{dist.get_world_size()}). Received: a second init for {cluster.task_name}. "
            "Call init_process_group once per process, or destroy_process_group() first."
        )
    wait = _as_timedelta(timeout)
    start = time.monotonic()
    deadline = start + wait.total_seconds()

    def steps(meeting: _Meeting) -> Rendezvous:
        met = _connect(cluster, rank, wait, agent_store, apart)
        store = met.store
        meeting.phase = "claiming its task"
        try:
            _claim(store, cluster, rank)
        except dist.DistNetworkError as exc:
            raise _lost_chief(cluster, rank, exc) from exc
        meeting.phase = "arriving"
        store.set(_TOKEN.format(rank=rank), _token_digest(token))
        store.set(_ARRIVED.format(rank=rank), cluster.task_name)
        logger.info(
            "%s (rank %d) arrived at %s:%d; waiting for %d ranks",
            cluster.task_name,
            rank,
            cluster.master_addr,
            cluster.master_port,
            cluster.world_size,
        )
        meeting.phase = "waiting for the other ranks"
        _wait_for_all(store, cluster, rank, wait, deadline, start + wait.total_seconds() * STALL_FRACTION)
        meeting.phase = "checking the cluster tokens"
        _check_tokens(store, cluster, rank, timedelta(seconds=max(0.001, deadline - time.monotonic())))
        return met

    met: Rendezvous = _bounded_meeting(cluster, rank, wait, steps, start)
    import_group_defaults()
    options: dict[str, Any] = {} if device_id is None else {"device_id": device_id}
    group_wait = wait if group_timeout is None else _as_timedelta(group_timeout, "group_timeout")
    dist.init_process_group(
        backend, store=met.store, rank=rank, world_size=cluster.world_size, timeout=group_wait, **options
    )
    return met


_agent_meetings = itertools.count()


def agent_store_prefix(cluster: Cluster, env: Mapping[str, str]) -> str | None:
    """The key prefix for torchrun's agent store, or None when this process must serve its own store.

    torchrun (its elastic agent) serves a TCP store at MASTER_PORT and tells its workers so with
    ``TORCHELASTIC_USE_AGENT_STORE=True``; ``TORCHELASTIC_RESTART_COUNT`` numbers its restarts. That
    store outlives every strategy, so each call names a fresh meeting: every rank builds its
    strategies in the same order, so the n-th strategy of every rank meets under the same keys, and
    never under the keys an earlier one left there.
    """
    if cluster.source != "torchrun" or env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    return f"/stratagem/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/meeting_{next(_agent_meetings)}"


def import_group_defaults() -> None:
    """Imports, before there is a process group, the torch module whose functions take ``group=group.WORLD``
    as a default argument. Imported later (torch does so lazily, e.g. from ``load_state_dict``), those
    defaults hold the process group itself, so ``destroy_process_group()`` cannot free it: Gloo's threads
    then live on into interpreter shutdown, and one that releases a finished collective there aborts the
    process ("terminate called without an active exception", SIGABRT after a successful run)."""
    import torch.distributed.nn  # noqa: F401  (for its side effect on import order)
