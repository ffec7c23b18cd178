"""Rendezvous: the ranks of a ``Cluster`` meet at the chief's TCP store, then form a process group.

torch.distributed's own rendezvous, on timeout, says only that it timed out. Before handing the
store to it, every rank records its arrival under ``stratagem/arrived/<rank>``; if the wait runs
out, the keys that exist say exactly which ranks (and so which tasks) never came.
"""

from __future__ import annotations

import hashlib
import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from stratagem.cluster.spec import Cluster
from stratagem.errors import ClusterError, CollectiveTimeoutError, RendezvousError

logger = logging.getLogger(__name__)

_ARRIVED = "stratagem/arrived/{rank}"
_TOKEN = "stratagem/token/{rank}"
_CHECKED = "stratagem/checked/{rank}"


def _as_timedelta(timeout: float | timedelta) -> timedelta:
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not seconds > 0:
        raise ClusterError(f"The rendezvous timeout must be positive. Received: timeout={timeout!r}. "
                           "Fix: pass a number of seconds, e.g. timeout=300.")
    return timedelta(seconds=seconds)


def _token_digest(token: str | None) -> str:
    # Only a digest travels through the (unauthenticated) store, never the token itself.
    return hashlib.sha256(token.encode()).hexdigest()[:16] if token else "-"


def _connect(cluster: Cluster, rank: int, timeout: timedelta) -> dist.TCPStore:
    where = f"{cluster.master_addr}:{cluster.master_port}"
    try:
        return dist.TCPStore(cluster.master_addr, cluster.master_port, cluster.world_size,
                             is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    except dist.DistNetworkError as exc:
        if rank == 0:
            raise ClusterError(
                f"The chief ({cluster.task_name}) cannot listen at {where}: {str(exc).splitlines()[0]} "
                f"Received: master_addr={cluster.master_addr!r}, master_port={cluster.master_port}. "
                "Fix: choose a free port for the chief (another process may hold this one)."
            ) from exc
        raise CollectiveTimeoutError(
            f"Rank {rank} ({cluster.task_name}) could not reach the chief (rank 0, {cluster.task_for_rank(0)}) "
            f"at {where} within {timeout.total_seconds():g} s. Missing: rank 0 ({cluster.task_for_rank(0)}). "
            "Fix: start the chief, check that it listens at that address and port, or raise the timeout."
        ) from exc


def _lost_chief(cluster: Cluster, rank: int, exc: Exception) -> RendezvousError:
    return RendezvousError(
        f"Rank {rank} ({cluster.task_name}) lost the connection to the chief (rank 0, "
        f"{cluster.task_for_rank(0)}) at {cluster.master_addr}:{cluster.master_port} during the rendezvous. "
        f"Received: {str(exc).splitlines()[0]} Fix: the chief probably exited; read its log for the cause."
    )


def _wait_for_all(store: dist.TCPStore, cluster: Cluster, rank: int, timeout: timedelta) -> None:
    keys = [_ARRIVED.format(rank=r) for r in range(cluster.world_size)]
    try:
        store.wait(keys, timeout)
    except dist.DistStoreError as exc:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        names = ", ".join(f"rank {r} ({cluster.task_for_rank(r)})" for r in missing)
        raise CollectiveTimeoutError(
            f"Rendezvous at {cluster.master_addr}:{cluster.master_port} timed out after "
            f"{timeout.total_seconds():g} s on rank {rank} ({cluster.task_name}): "
            f"{len(missing)} of {cluster.world_size} ranks did not arrive. Missing: {names}. "
            "Fix: start the missing tasks (check their logs for an earlier crash), or raise the timeout."
        ) from exc
    except dist.DistNetworkError as exc:
        raise _lost_chief(cluster, rank, exc) from exc


def _check_tokens(store: dist.TCPStore, cluster: Cluster, rank: int, timeout: timedelta) -> None:
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
        "Fix: a process from another launch is using this address; stop it, or give every task "
        "the same STRATAGEM_CLUSTER_TOKEN."
    )


def init_process_group(
    cluster: Cluster,
    backend: str = "gloo",
    timeout: float | timedelta = 300.0,
    *,
    token: str | None = None,
    device_id: torch.device | None = None,
) -> dist.TCPStore:
    """Meet every rank of ``cluster`` at the chief's TCP store and initialize torch.distributed.

    Raises ``CollectiveTimeoutError`` naming the ranks and tasks that did not arrive within
    ``timeout``, ``RendezvousError`` when the chief goes away meanwhile, and ``ClusterError`` when this task has no rank (``ps``, ``evaluator``), the
    backend is not built into torch, or ``token`` (``STRATAGEM_CLUSTER_TOKEN``) differs from
    the chief's. Returns the store, which stays usable for later coordination. ``device_id`` (a CUDA
device, for NCCL) is handed to ``torch.distributed.init_process_group``: the communicator forms at
once on that GPU; set it as the current device first (``torch.cuda.set_device``).

    Example:
        >>> cluster = resolve_cluster(env=environ.current())          # doctest: +SKIP
        >>> store = init_process_group(cluster, "gloo", timeout=60)   # doctest: +SKIP
        >>> torch.distributed.all_reduce(torch.ones(1))               # doctest: +SKIP
    """
    rank = cluster.rank
    if rank is None:
        raise ClusterError(
            f"Task {cluster.task_name} is not a member of the collective world, so it has no rank to "
            f"join with. Received: task_type={cluster.task_type!r}. Fix: only the chief and workers call "
            "init_process_group; parameter servers and the evaluator serve over gRPC instead."
        )
    if not dist.is_available() or not dist.is_backend_available(backend):
        raise ClusterError(
            f"torch.distributed backend {backend!r} is not available in this torch build. "
            f"Received: backend={backend!r}, torch built with gloo={dist.is_gloo_available()}, "
            f"nccl={dist.is_nccl_available()}. Fix: use 'gloo' on CPU, 'nccl' with a CUDA build of torch."
        )
    if dist.is_initialized():
        raise ClusterError(
            f"torch.distributed is already initialized in this process (rank {dist.get_rank()} of "
            f"{dist.get_world_size()}). Received: a second init for {cluster.task_name}. "
            "Fix: call init_process_group once per process, or destroy_process_group() first."
        )
    wait = _as_timedelta(timeout)
    store = _connect(cluster, rank, wait)
    store.set(_TOKEN.format(rank=rank), _token_digest(token))
    store.set(_ARRIVED.format(rank=rank), cluster.task_name)
    logger.info("%s (rank %d) arrived at %s:%d; waiting for %d ranks", cluster.task_name, rank,
                cluster.master_addr, cluster.master_port, cluster.world_size)
    _wait_for_all(store, cluster, rank, wait)
    _check_tokens(store, cluster, rank, wait)
    import_group_defaults()
    options = {} if device_id is None else {"device_id": device_id}
    dist.init_process_group(backend, store=store, rank=rank, world_size=cluster.world_size, timeout=wait, **options)
    return store


def import_group_defaults() -> None:
    """Imports, before there is a process group, the torch module whose functions take ``group=group.WORLD``
    as a default argument. Imported later (torch does so lazily, e.g. from ``load_state_dict``), those
    defaults hold the process group itself, so ``destroy_process_group()`` cannot free it: Gloo's threads
    then live on into interpreter shutdown, and one that releases a finished collective there aborts the
    process ("terminate called without an active exception", SIGABRT after a successful run)."""
    import torch.distributed.nn  # noqa: F401  (for its side effect on import order)
