"""Under torchrun every rank joins the store its agent serves, so no second server fails to bind."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from helpers import free_port

from stratagem.cluster import resolve_cluster
from stratagem.cluster.rendezvous import agent_store_prefix, init_process_group


def _torchrun_env(port: int, **extra: str) -> dict[str, str]:
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **extra}


def test_the_agent_store_is_used_only_when_torchrun_says_so() -> None:
    cluster = resolve_cluster(None, env=_torchrun_env(29500))
    assert agent_store_prefix(cluster, _torchrun_env(29500)) is None
    env = _torchrun_env(29500, TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="2")
    assert agent_store_prefix(cluster, env) == "/stratagem/attempt_2"
    tf_config = resolve_cluster(None, env={"TF_CONFIG": '{"cluster": {"worker": ["127.0.0.1:1"]}, '
                                                        '"task": {"type": "worker", "index": 0}}'})
    assert agent_store_prefix(tf_config, env) is None


@pytest.mark.timeout(60)
def test_the_chief_joins_the_agents_store_without_a_failed_bind(monkeypatch: pytest.MonkeyPatch,
                                                                 capfd: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)  # what torchrun's agent serves
    # c10d reads this variable itself: with it, a second server on the port logs "failed to bind" and carries on.
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    env = _torchrun_env(port, TORCHELASTIC_USE_AGENT_STORE="True")
    cluster = resolve_cluster(None, env=env)
    try:
        init_process_group(cluster, "gloo", timeout=30, agent_store=agent_store_prefix(cluster, env))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert "failed to bind" not in capfd.readouterr().err
    assert agent.check(["/stratagem/attempt_0/stratagem/arrived/0"])  # the arrival went to the agent's store
