"""Handing the rendezvous store back at close(): the chief waits for every rank, the others wait until
the chief's store is gone, and a rank that never comes is named in a warning after the timeout."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from helpers import free_port

from stratagem.cluster.release import release_store

NAMES = ["worker:0", "worker:1"]


def _stores(port: int):
    server = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=10))
    return server, client


@pytest.mark.timeout(60)
def test_the_port_is_free_again_once_both_ranks_released():
    port = free_port()
    server, client = _stores(port)
    done = []

    def worker():
        release_store(client, rank=1, task_names=NAMES, timeout=20)
        done.append(time.monotonic())

    thread = threading.Thread(target=worker)
    thread.start()
    release_store(server, rank=0, task_names=NAMES, timeout=20)
    del server  # what MultiWorkerMirroredStrategy.close() does next: the chief's store stops listening
    thread.join(timeout=20)
    assert done, "rank 1 did not return once the chief's store went away"
    again = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    again.set("k", "v")  # a new rendezvous at the same address


@pytest.mark.timeout(60)
def test_the_chief_names_a_rank_that_never_closes(caplog):
    server, _client = _stores(free_port())
    with caplog.at_level(logging.WARNING, logger="stratagem.cluster.release"):
        start = time.monotonic()
        release_store(server, rank=0, task_names=NAMES, timeout=0.5)
    assert time.monotonic() - start < 5
    assert "without hearing that worker:1 closed" in caplog.text
