"""Letting go of the rendezvous store, so that a later strategy in the same process can meet again.

The chief's TCP store listens at the cluster's address for as long as the store object lives. To
build a second strategy at the same address after `close()`, the chief must stop listening, and the
other ranks must not connect again before it has: a rank that reached the old store would find the
previous rendezvous's keys there and believe everyone had arrived. So every rank says it is done;
the chief waits for all of them and then drops its store; every other rank waits until the chief's
store has gone away (its connection drops) before `close()` returns.

A rank learns that the chief's store has gone through a plain TCP connection of its own to the store's
address, opened before it says it is done and never written to: the server closes it when it stops. Waiting
on the store itself for that instead (a key that is never set) also ends when the connection drops, but
torch's TCPStore client prints a C++ warning with a backtrace when its call fails that way, after a normal
end.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)

_CLOSED = "stratagem/closed/{rank}"
_NEVER = "stratagem/closed/never"  # never set: waiting for it ends when the chief's store goes away


def release_store(store: Any, *, rank: int, task_names: Sequence[str], timeout: float, owned: bool = True) -> None:
    """Every rank calls this once with its store, then drops the store; returns when the chief's is gone.

    Bounded by `timeout`: a rank that never comes (it crashed) is named in a warning and left behind,
    since nothing is lost by closing without it. ``owned=False``: the store belongs to someone else
    (torchrun's agent) and outlives every rank, so there is nothing to wait for; the next strategy
    meets under keys of its own (see `stratagem.cluster.rendezvous.agent_store_prefix`).
    """
    wait = timedelta(seconds=timeout)
    watch = _watch(store, timeout) if owned and rank != 0 else None
    try:
        store.set(_CLOSED.format(rank=rank), "1")
    except dist.DistError:
        if watch is not None:
            watch.close()
        return  # the chief's store is already gone: nothing to hand back
    if not owned:
        return
    if rank == 0:
        keys = [_CLOSED.format(rank=r) for r in range(len(task_names))]
        try:
            store.wait(keys, wait)
        except dist.DistError:
            missing = [task_names[r] for r, key in enumerate(keys) if not store.check([key])]
            logger.warning(
                "The chief closes its rendezvous store after %g s without hearing that %s closed too; "
                "a strategy built there again would not meet them.",
                timeout,
                ", ".join(missing),
            )
        return
    if watch is not None:
        if _closed_by_server(watch):
            return  # the chief's store went away: its port is free for the next strategy
    else:
        try:
            store.wait([_NEVER], wait)
        except dist.DistNetworkError:
            return  # the chief's store went away: its port is free for the next strategy
        except dist.DistError:
            pass  # timed out: said below
    logger.warning(
        "%s closed, but the chief (%s) still holds its rendezvous store after %g s; a strategy built "
        "again now could meet the old one.",
        task_names[rank],
        task_names[0],
        timeout,
    )


def _watch(store: Any, timeout: float) -> socket.socket | None:
    """A connection of our own to the chief's TCP store, which the server closes when it stops; None for a
    store that is not a TCPStore, or when the connection cannot be made (then the store itself is waited on)."""
    if not isinstance(store, dist.TCPStore):
        return None
    try:
        return socket.create_connection((store.host, store.port), timeout=timeout)
    except OSError:
        return None


def _closed_by_server(watch: socket.socket) -> bool:
    """Whether the server closed `watch` within its timeout (it never writes to it)."""
    try:
        while watch.recv(4096):
            pass
        return True
    except (ConnectionError, OSError) as error:
        return not isinstance(error, TimeoutError)
    finally:
        watch.close()
