"""The shared-memory sum of co-located workers: ranks are threads of this process, meeting through an
in-process store, each mapping the shared file on its own (as separate processes do)."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from stratagem.errors import ReplicaError
from stratagem.shm import files as shm_files
from stratagem.shm import sums as shared_memory
from stratagem.shm.sums import SharedMemoryGroup, connect

pytestmark = pytest.mark.skipif(shared_memory.eligible() is not None, reason="shared-memory sums need Linux on x86-64")

NAMES = [f"worker:{r}" for r in range(4)]


class Failure(Exception):
    def __init__(self, what: str, step: int, error: Exception | None) -> None:
        super().__init__(f"{what} of step {step}: {'timed out' if error is None else error}")
        self.error = error


def run_ranks(
    world: int,
    body: Callable[[int, SharedMemoryGroup | None, str, bool], Any],
    *,
    timeout: float = 10.0,
    stalls: list | None = None,
    limit: float = 60.0,
    **options: Any,
) -> list[Any]:
    """``body(rank, group, reason, fell_back)`` on ``world`` threads that connect through one store; their results, in
    rank order (an exception in a thread is re-raised here)."""
    store = dist.HashStore()
    namespace = uuid.uuid4().hex  # the threads share one process, so its count of groups made is no use
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            per_rank = {k: v[rank] if isinstance(v, list) else v for k, v in options.items()}
            group, reason, fell_back = connect(
                store,
                rank=rank,
                world_size=world,
                task_names=NAMES[:world],
                timeout=timeout,
                stall_warning_after=timeout / 4,
                on_failure=Failure,
                on_stall=lambda what, step, start: stalls.append((rank, what, step)) if stalls is not None else None,
                namespace=namespace,
                **per_rank,
            )
            try:
                results[rank] = body(rank, group, reason, fell_back)
            finally:
                if group is not None:
                    group.close()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(limit)
        assert not thread.is_alive(), "a rank is still running: a wait did not end"
    if errors:
        raise errors[0]
    return results


def rank_order_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = torch.add(tensors[0], tensors[1])
    for t in tensors[2:]:
        total = total + t
    return total


@settings(max_examples=25, deadline=None)
@given(
    world=st.integers(2, 3),
    numel=st.integers(0, 700),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64]),
    capacity=st.sampled_from([64, 256, 4096]),
    seed=st.integers(0, 2**16),
)
def test_every_rank_gets_the_sum_in_rank_order_bit_for_bit(world, numel, dtype, capacity, seed):
    generator = torch.Generator().manual_seed(seed)
    inputs = [(torch.randn(numel, generator=generator) * 100).to(dtype) for _ in range(world)]

    def body(rank, group, reason, fell_back):
        assert group is not None, reason
        tensor = inputs[rank].clone()
        group.all_reduce_(tensor, what="sum", step=0)
        return tensor

    results = run_ranks(world, body, capacity=capacity)  # small slots: most tensors go in several chunks
    expected = rank_order_sum(inputs)
    for result in results:
        assert torch.equal(result, expected)


def test_many_collectives_in_a_row_at_uneven_speeds_stay_correct():
    # Ranks that arrive at different times: a fast rank must not copy a sum out before every slice of it is
    # summed, nor write the next collective's data while a slow rank still sums the last.
    world, rounds = 3, 60

    def body(rank, group, reason, fell_back):
        rng = random.Random(rank)
        out = []
        for k in range(rounds):
            if rng.random() < 0.3:
                time.sleep(rng.random() * 2e-3)
            tensor = torch.full((k % 7 * 50 + 1,), float(rank + 1) * (k + 1), dtype=torch.float64)
            group.all_reduce_(tensor, what="sum", step=k)
            out.append(tensor)
        return out

    results = run_ranks(world, body, capacity=512)
    for k in range(rounds):
        expected = torch.full((k % 7 * 50 + 1,), 6.0 * (k + 1), dtype=torch.float64)
        for rank in range(world):
            assert torch.equal(results[rank][k], expected), (rank, k)


def test_a_rank_that_never_arrives_is_waited_for_until_the_timeout_with_a_stall_warning():
    stalls: list = []

    def body(rank, group, reason, fell_back):
        if rank == 1:
            time.sleep(1.5)  # stays connected, never sums
            return None
        start = time.monotonic()
        with pytest.raises(Failure) as caught:
            group.all_reduce_(torch.ones(4), what="gradient all-reduce", step=7)
        elapsed = time.monotonic() - start
        assert caught.value.error is None  # a timeout, not a lost rank
        assert "gradient all-reduce of step 7: timed out" in str(caught.value)
        with pytest.raises(ReplicaError, match="unusable after an earlier failure"):
            group.all_reduce_(torch.ones(4), what="gradient all-reduce", step=8)
        return elapsed

    elapsed = run_ranks(2, body, timeout=0.6, stalls=stalls)[0]
    assert 0.6 <= elapsed < 1.5
    assert stalls == [(0, "gradient all-reduce", 7)]


def test_a_rank_whose_process_dies_is_named_long_before_the_timeout():
    # Rank 1's process, as rank 0 sees it, is a child that is killed while rank 0 waits.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:

        def body(rank, group, reason, fell_back):
            if rank == 1:
                return None
            threading.Timer(0.3, child.kill).start()
            start = time.monotonic()
            with pytest.raises(Failure) as caught:
                group.all_reduce_(torch.ones(4), what="gradient all-reduce", step=3)
            assert isinstance(caught.value.error, ReplicaError)
            assert f"worker:1 (pid {child.pid}) exited during the shared-memory gradient all-reduce" in str(
                caught.value.error
            )
            return time.monotonic() - start

        process = [None, (child.pid, shared_memory.process_start(child.pid))]
        assert run_ranks(2, body, timeout=30, process=process)[0] < 3.0
    finally:
        child.kill()
        child.wait(timeout=30)


def test_a_rank_whose_process_cannot_be_seen_is_left_to_the_timeout():
    # Another pid namespace: the pid names no process here (or another one), so only the clock can tell.
    def body(rank, group, reason, fell_back):
        if rank == 1:
            time.sleep(1.2)
            return None
        with pytest.raises(Failure) as caught:
            group.all_reduce_(torch.ones(4), what="gradient all-reduce", step=3)
        return caught.value.error

    assert run_ranks(2, body, timeout=0.5, process=[None, (os.getpid(), "not-its-start-time")])[0] is None


def test_the_file_is_unlinked_once_every_rank_has_mapped_it(tmp_path):
    def body(rank, group, reason, fell_back):
        assert group is not None, reason
        tensor = torch.full((10,), float(rank))
        group.all_reduce_(tensor, what="sum", step=0)
        return tensor, os.listdir(tmp_path)

    results = run_ranks(2, body, directory=str(tmp_path))
    for tensor, listing in results:
        assert torch.equal(tensor, torch.ones(10))
        assert listing == []
    assert "shared memory" in run_ranks(2, lambda rank, group, reason, fell_back: reason, directory=str(tmp_path))[0]


def test_workers_on_different_hosts_all_stay_on_the_process_group():
    reasons = run_ranks(2, lambda rank, group, reason, fell_back: (group, reason, fell_back), host=["a/1", "b/2"])
    assert reasons == [(None, "the workers run on 2 hosts", False)] * 2


def test_one_rank_that_cannot_take_part_keeps_every_rank_out():
    reasons = run_ranks(
        3,
        lambda rank, group, reason, fell_back: (group, reason, fell_back),
        why_not=[None, "turned off (shared_memory=False)", None],
    )
    assert reasons == [(None, "worker:1: turned off (shared_memory=False)", False)] * 3


def test_the_switch_keeps_every_rank_on_the_process_group_without_a_warning(monkeypatch):
    monkeypatch.setenv("STRATAGEM_SHARED_MEMORY", "0")
    reasons = run_ranks(2, lambda rank, group, reason, fell_back: (group, reason, fell_back))
    assert reasons == [(None, "turned off by STRATAGEM_SHARED_MEMORY=0", False)] * 2


def test_a_single_worker_has_nothing_to_share():
    assert run_ranks(1, lambda rank, group, reason, fell_back: (group, reason, fell_back)) == [
        (None, "one worker: nothing to sum across processes", False)
    ]


def test_a_full_directory_is_reported_and_nothing_is_left_in_it(tmp_path, monkeypatch):
    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    reasons = run_ranks(2, lambda rank, group, reason, fell_back: (group, reason, fell_back), directory=str(tmp_path))
    assert reasons[0][0] is None and reasons[0] == reasons[1]
    assert f"{tmp_path} has no room for 12.0 MiB" in reasons[0][1]
    assert reasons[0][2] is True  # one host, nobody turned it off: a slower job the user is told of
    assert os.listdir(tmp_path) == []


def test_a_rank_that_never_checks_in_is_named():
    store = dist.HashStore()
    with pytest.raises(
        Exception,
        match=r"worker:0 \(rank 0\) waited 0.3 s for the shared-memory check-in from worker:1. "
        r"Received: \w+. Check that every worker is running, or raise the timeout.$",
    ):
        connect(
            store,
            rank=0,
            world_size=2,
            task_names=NAMES[:2],
            timeout=0.3,
            stall_warning_after=0.1,
            on_failure=Failure,
            on_stall=lambda *a: None,
        )


_RANK_ZERO = """
import json, os, sys, time
import torch.distributed as dist
from stratagem.shm.sums import connect
store = dist.FileStore(sys.argv[1], 2)
connect(store, rank=0, world_size=2, task_names=["worker:0", "worker:1"], timeout=60, stall_warning_after=60,
        on_failure=lambda *a: RuntimeError(a), on_stall=lambda *a: None, namespace="leak", directory=sys.argv[2])
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_rank_zero_killed_while_rank_one_is_slow_to_map_leaves_no_file(tmp_path, monkeypatch):
    # Rank 0 (a real process) makes the file and is SIGKILLed while rank 1 has not mapped it yet: rank 0
    # never unlinks it. It was left behind (12 MiB for two workers); now rank 1 removes it once every rank
    # has mapped it.
    directory = tmp_path / "shm"
    directory.mkdir()
    store_path = str(tmp_path / "store")
    rank_zero = subprocess.Popen([sys.executable, "-c", _RANK_ZERO, store_path, str(directory)])
    store = dist.FileStore(store_path, 2)
    real_open = shm_files.open_mapped

    def slow_open(path, size, head, **kwargs):
        store.wait(["stratagem/shm/leak/mapped/0"], timedelta(seconds=40))  # rank 0 has mapped it, and waits
        rank_zero.kill()
        rank_zero.wait()
        assert os.listdir(directory) == [os.path.basename(path)]
        return real_open(path, size, head, **kwargs)

    monkeypatch.setattr(shm_files, "open_mapped", slow_open)
    try:
        group, reason, _ = connect(
            store,
            rank=1,
            world_size=2,
            task_names=NAMES[:2],
            timeout=40,
            stall_warning_after=40,
            on_failure=Failure,
            on_stall=lambda *a: None,
            namespace="leak",
            directory=str(directory),
        )
        assert group is not None, reason
        group.close()
    finally:
        rank_zero.kill()
        rank_zero.wait()
    assert os.listdir(directory) == []


@settings(max_examples=20, deadline=None)
@given(
    world=st.integers(2, 3),
    numel=st.integers(0, 300),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64]),
    capacity=st.sampled_from([64, 256, 4096]),
    seed=st.integers(0, 2**16),
)
def test_all_gather_and_reduce_scatter_hand_each_rank_its_blocks_bit_for_bit(world, numel, dtype, capacity, seed):
    # FSDP2's two collectives over the shared file (strategies/sharded/transport.py), in chunks when slots are small.
    generator = torch.Generator().manual_seed(seed)
    shards = [(torch.randn(numel, generator=generator) * 100).to(dtype) for _ in range(world)]
    grads = [(torch.randn(world * numel, generator=generator) * 100).to(dtype) for _ in range(world)]
    weights = [1.0, 0.375, 0.2][:world] if dtype.is_floating_point else [1.0] * world  # n_r / N of uneven splits

    def body(rank, group, reason, fell_back):
        assert group is not None, reason
        gathered = torch.full((world * numel,), -1).to(dtype)
        group.all_gather_into_(gathered, shards[rank], what="all-gather", step=0)
        block = torch.full((numel,), -1).to(dtype)
        group.reduce_scatter_(block, grads[rank], what="reduce-scatter", step=0)
        # FSDP2's own layout: the shard copied into this rank's block of the output, then gathered in place.
        in_place = torch.full((world * numel,), -1).to(dtype)
        in_place[rank * numel : (rank + 1) * numel] = shards[rank]
        group.all_gather_into_(in_place, in_place[rank * numel : (rank + 1) * numel], what="all-gather", step=0)
        scaled = torch.full((numel,), -1).to(dtype)
        group.reduce_scatter_(scaled, grads[rank], what="reduce-scatter", step=0, scale=weights[rank])
        total = torch.zeros(1, dtype=torch.float64)
        group.all_reduce_(total, what="sum", step=0)  # the collectives share one count of steps
        return gathered, block, in_place, scaled

    results = run_ranks(world, body, capacity=capacity)
    whole = rank_order_sum(grads)
    weighted = rank_order_sum([g.mul(w) for g, w in zip(grads, weights)])  # as WeightedReduceScatter's mul_ then sum
    for rank, (gathered, block, in_place, scaled) in enumerate(results):
        assert torch.equal(gathered, torch.cat(shards))
        assert torch.equal(block, whole[rank * numel : (rank + 1) * numel])
        assert torch.equal(in_place, torch.cat(shards))
        assert torch.equal(scaled, weighted[rank * numel : (rank + 1) * numel])


def test_a_collective_after_close_is_refused_saying_the_group_was_closed():
    # A sharded model used after strategy.close() calls its units' all-gather on the closed group.
    def body(rank, group, reason, fell_back):
        assert group is not None, reason
        group.close()
        with pytest.raises(ReplicaError, match=r"was closed \(strategy.close\(\)\)"):
            group.all_gather_into_(torch.zeros(4), torch.zeros(2), what="all-gather", step=1)
        return True

    assert run_ranks(2, body) == [True, True]
