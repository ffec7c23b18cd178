"""Under torchrun every rank joins the store its agent serves, so no second server fails to bind."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import free_port

from stratagem.cluster import resolve_cluster
from stratagem.cluster.release import release_store
from stratagem.cluster.rendezvous import agent_store_prefix, init_process_group


def _torchrun_env(port: int, **extra: str) -> dict[str, str]:
    return {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        **extra,
    }


def test_the_agent_store_is_used_only_when_torchrun_says_so() -> None:
    cluster = resolve_cluster(None, env=_torchrun_env(29500))
    assert agent_store_prefix(cluster, _torchrun_env(29500)) is None
    env = _torchrun_env(29500, TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="2")
    first, second = agent_store_prefix(cluster, env), agent_store_prefix(cluster, env)
    assert re.fullmatch(r"/stratagem/attempt_2/meeting_\d+", first) and first != second  # a fresh meeting each time
    tf_config = resolve_cluster(
        None, env={"TF_CONFIG": '{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}'}
    )
    assert agent_store_prefix(tf_config, env) is None


@pytest.mark.timeout(60)
def test_the_chief_joins_the_agents_store_without_a_failed_bind(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)  # what torchrun's agent serves
    # c10d reads this variable itself: with it, a second server on the port logs "failed to bind" and carries on.
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    env = _torchrun_env(port, TORCHELASTIC_USE_AGENT_STORE="True")
    cluster = resolve_cluster(None, env=env)
    prefix = agent_store_prefix(cluster, env)
    try:
        init_process_group(cluster, "gloo", timeout=30, agent_store=prefix)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert "failed to bind" not in capfd.readouterr().err
    assert agent.check([f"{prefix}/stratagem/arrived/0"])  # the arrival went to the agent's store


@pytest.mark.timeout(60)
def test_closing_on_the_agents_store_does_not_wait_for_it_to_go_away() -> None:
    # A rank other than the chief waits, on a store the chief owns, until that store is gone; the agent's never goes.
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    client = dist.PrefixStore(
        "/stratagem/attempt_0/meeting_0",
        dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=20)),
    )
    started = time.monotonic()
    release_store(client, rank=1, task_names=["worker:0", "worker:1"], timeout=20, owned=False)
    assert time.monotonic() - started < 5
    assert agent.check(["/stratagem/attempt_0/meeting_0/stratagem/closed/1"])


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_under_torchrun_nothing_fails_to_bind_and_close_returns() -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [
        str(torchrun),
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(Path(__file__).with_name("workers") / "torchrun_strategy.py"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "failed to bind" not in done.stderr
    assert "meeting 0: sum over ranks 2" in done.stdout and "meeting 1: sum over ranks 2" in done.stdout
