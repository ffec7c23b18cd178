"""Rendezvous at the chief's TCP store: a working 2-rank world, and failures that name who is missing."""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers import free_port, run_ranks
from workers.close_and_again import can_listen

from stratagem.cluster import Cluster, init_process_group, parse_tf_config, single_process
from stratagem.cluster.rendezvous import join_process_group
from stratagem.errors import ClusterError, CollectiveTimeoutError, RendezvousError

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]


def two_workers(port: int, rank: int) -> Cluster:
    """worker:0 (the chief, rank 0) listens at ``port``; worker:1 is rank 1."""
    return parse_tf_config(
        {
            "cluster": {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}"]},
            "task": {"type": "worker", "index": rank},
        }
    )


def _all_reduce_rank(rank: int, port: int) -> list[float]:
    cluster = two_workers(port, rank)
    init_process_group(cluster, "gloo", timeout=20, token="same")
    try:
        tensor = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
        dist.all_reduce(tensor)
        return [*tensor.tolist(), float(dist.get_rank()), float(dist.get_world_size())]
    finally:
        dist.destroy_process_group()


def test_two_ranks_meet_and_all_reduce():
    outcomes = run_ranks(_all_reduce_rank, [0, 1], args=(free_port(),), timeout=45)
    for rank, outcome in outcomes.items():
        assert outcome.error is None, outcome.error
        # [1, 10] + [2, 20] = [3, 30], on every rank.
        assert outcome.value == [3.0, 30.0, float(rank), 2.0]


def test_missing_rank_is_named_within_the_timeout():
    cluster = two_workers(free_port(), 0)
    start = time.monotonic()
    with pytest.raises(
        CollectiveTimeoutError,
        match=r"Rendezvous at 127\.0\.0\.1:\d+ timed out after 1\.5 s on rank 0 "
        r"\(worker:0\): 1 of 2 ranks did not arrive\. Missing: rank 1 "
        r"\(worker:1\)\. Start the missing tasks",
    ):
        init_process_group(cluster, "gloo", timeout=1.5)
    assert time.monotonic() - start < 5
    assert not dist.is_initialized()


def test_missing_chief_is_named_within_the_timeout():
    cluster = two_workers(free_port(), 1)
    start = time.monotonic()
    with pytest.raises(
        CollectiveTimeoutError,
        match=r"Rank 1 \(worker:1\) could not reach the chief \(rank 0, "
        r"worker:0\) at 127\.0\.0\.1:\d+ within 1 s\. Missing: rank 0",
    ):
        init_process_group(cluster, "gloo", timeout=1.0)
    assert time.monotonic() - start < 8


def test_ranks_with_different_tokens_both_fail():
    port, errors = free_port(), {}

    def rank_thread(rank: int, token: str) -> None:
        try:
            init_process_group(two_workers(port, rank), "gloo", timeout=10, token=token)
        except ClusterError as exc:
            errors[rank] = str(exc)

    threads = [threading.Thread(target=rank_thread, args=(rank, f"token-{rank}")) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert sorted(errors) == [0, 1]
    for message in errors.values():
        assert "different cluster token from the chief's joined the rendezvous" in message
        assert "rank 1 (worker:1)" in message and "STRATAGEM_CLUSTER_TOKEN" in message
    assert not dist.is_initialized()


def test_chief_cannot_listen_on_a_taken_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cluster = two_workers(taken.getsockname()[1], 0)
        with pytest.raises(
            ClusterError,
            match=r"The chief \(worker:0\) cannot listen at 127\.0\.0\.1:\d+: .*"
            r"Choose a free port for the chief",
        ):
            init_process_group(cluster, "gloo", timeout=2)


def test_single_process_group_and_double_init():
    init_process_group(single_process(), "gloo", timeout=10)
    try:
        tensor = torch.tensor([2.0])
        dist.all_reduce(tensor)
        assert tensor.item() == 2.0
        with pytest.raises(
            ClusterError,
            match=r"already initialized in this process \(rank 0 of 1\)\. "
            r"Received: a second init for worker:0",
        ):
            init_process_group(single_process(), "gloo", timeout=10)
    finally:
        dist.destroy_process_group()


def test_parameter_servers_have_no_rank_to_join_with():
    ps = parse_tf_config(
        {"cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, "task": {"type": "ps", "index": 0}}
    )
    with pytest.raises(
        ClusterError,
        match=r"Task ps:0 is not a member of the collective world.*"
        r"Received: task_type='ps'",
    ):
        init_process_group(ps, "gloo", timeout=1)


@pytest.mark.skipif(dist.is_nccl_available(), reason="this torch build has NCCL")
def test_unavailable_backend():
    with pytest.raises(
        ClusterError,
        match=r"backend 'nccl' is not available in this torch build\. "
        r"Received: backend='nccl', torch built with gloo=True, nccl=False",
    ):
        init_process_group(single_process(), "nccl", timeout=1)


@pytest.mark.parametrize("timeout", [0, -1.0])
def test_timeout_must_be_positive(timeout):
    with pytest.raises(
        ClusterError, match=rf"timeout must be a finite number of seconds in \(0, 86400\]\. Received: timeout={timeout}"
    ):
        init_process_group(single_process(), "gloo", timeout=timeout)


def test_chief_that_goes_away_during_the_rendezvous_is_named():
    port, errors = free_port(), []
    chief_store = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False
    )

    def rank_one() -> None:
        try:
            init_process_group(two_workers(port, 1), "gloo", timeout=10)
        except RendezvousError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=rank_one)
    thread.start()
    chief_store.wait(["stratagem/arrived/1"], timedelta(seconds=10))
    del chief_store  # the chief exits: its store stops serving
    thread.join(timeout=20)
    assert len(errors) == 1
    assert re.match(
        r"Rank 1 \(worker:1\) lost the connection to the chief \(rank 0, worker:0\) at "
        r"127\.0\.0\.1:\d+ during the rendezvous\. Received: .* The chief probably exited",
        errors[0],
    )


def test_a_chief_port_that_accepts_but_never_answers_is_named_within_the_timeout():
    # A process holds the chief's port: the kernel accepts connections, nobody answers. torch's TCPStore
    # handshake waited for it far past the timeout (over 200 s against 5 s).
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import socket, sys, time\n"
                "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(16)\n"
                "print(s.getsockname()[1], flush=True); time.sleep(120)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(holder.stdout.readline())
        start = time.monotonic()
        with pytest.raises(
            CollectiveTimeoutError,
            match=rf"Rank 1 \(worker:1\) could not meet the chief \(rank 0, "
            rf"worker:0\) at 127\.0\.0\.1:{port} within 2 s: the address "
            r"accepts connections but its store never answered",
        ):
            init_process_group(two_workers(port, 1), "gloo", timeout=2.0)
        assert time.monotonic() - start < 2.0 + 1.5
    finally:
        holder.kill()
        holder.wait()


def test_the_rendezvous_warns_at_a_quarter_of_the_timeout_naming_who_has_not_arrived(caplog):
    caplog.set_level(logging.WARNING, logger="stratagem.cluster.rendezvous")
    with pytest.raises(CollectiveTimeoutError, match=r"Missing: rank 1 \(worker:1\)"):
        init_process_group(two_workers(free_port(), 0), "gloo", timeout=2.0)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert re.fullmatch(
        r"worker:0 \(rank 0\) has waited 0 s of 2 s at the rendezvous at 127\.0\.0\.1:\d+; "
        r"not arrived yet: rank 1 \(worker:1\)",
        warnings[0].getMessage(),
    )
    assert warnings[0].created - caplog.records[0].created < 1.5  # at a quarter, not at the end
    caplog.clear()
    port = free_port()
    with pytest.raises(CollectiveTimeoutError, match="could not reach the chief"):
        init_process_group(two_workers(port, 1), "gloo", timeout=2.0)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"worker:1 (rank 1) has waited 0 s of 2 s for the chief (rank 0, worker:0) at 127.0.0.1:{port}; not reached yet"
    ]


def test_the_chief_serves_its_store_apart_from_the_client_its_process_group_holds():
    # FSDP2's module state keeps the process group after close(): it must not keep the chief's port.
    met = join_process_group(single_process(), "gloo", timeout=10)  # port 0: the server picks one
    kept = dist.group.WORLD
    try:
        assert isinstance(met.server, dist.TCPStore) and met.store is not met.server
        met.store.set("written by", "the client")
        assert met.server.get("written by") == b"the client"  # one store, two ends
        tensor = torch.tensor([2.0])
        dist.all_reduce(tensor)
        assert tensor.item() == 2.0
    finally:
        dist.destroy_process_group()
    port = met.server.port
    assert not can_listen("127.0.0.1", port)
    del met
    assert kept is not None and can_listen("127.0.0.1", port)


def test_init_process_group_hands_back_the_chiefs_server_itself():
    store = init_process_group(single_process(), "gloo", timeout=10)
    try:
        assert isinstance(store, dist.TCPStore) and not can_listen("127.0.0.1", store.port)
    finally:
        dist.destroy_process_group()


def test_a_chief_meeting_again_while_it_still_holds_its_store_is_told_so():
    port = free_port()
    cluster = parse_tf_config({"cluster": {"worker": [f"127.0.0.1:{port}"]}, "task": {"type": "worker", "index": 0}})
    store = init_process_group(cluster, "gloo", timeout=10)  # kept, as an unclosed strategy keeps it
    dist.destroy_process_group()
    with pytest.raises(
        ClusterError,
        match=rf"Task worker:0 \(rank 0, address 127\.0\.0\.1:{port}\) of the job meeting at 127\.0\.0\.1:{port} is "
        r"still held by this very process: .* Close the earlier strategy \(strategy\.close\(\)\)",
    ):
        init_process_group(cluster, "gloo", timeout=5)
    del store
