"""Letting go of the rendezvous store, so that a later strategy in the same process can meet again.

The chief's TCP store listens at the cluster's address for as long as the store object lives. To
build a second strategy at the same address after `close()`, the chief must stop listening, and the
other ranks must not connect again before it has: a rank that reached the old store would find the
previous rendezvous's keys there and believe everyone had arrived. So every rank says it is done;
the chief waits for all of them and then drops its store; every other rank waits until the chief's
store has gone away (its connection drops) before `close()` returns.
"""

from __future__ import annotations

import logging
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
    try:
        store.set(_CLOSED.format(rank=rank), "1")
    except dist.DistError:
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
    try:
        store.wait([_NEVER], wait)
    except dist.DistNetworkError:
        return  # the chief's store went away: its port is free for the next strategy
    except dist.DistError:
        logger.warning(
            "%s closed, but the chief (%s) still holds its rendezvous store after %g s; a strategy built "
            "again now could meet the old one.",
            task_names[rank],
            task_names[0],
            timeout,
        )
