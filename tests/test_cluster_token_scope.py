"""What docs/clusters.md says of the multi-worker cluster token, checked: it keeps jobs apart, but any
client that reaches the chief's store reads the token's digest there, without credentials of any kind."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
import torch.distributed as dist

from stratagem.cluster import free_ports, parse_tf_config
from stratagem.cluster.rendezvous import _TOKEN, init_process_group

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]


def test_any_client_of_the_chief_store_reads_the_token_digest():
    port = free_ports(1)[0]
    chief = parse_tf_config({"cluster": {"worker": [f"127.0.0.1:{port}"]}, "task": {"type": "worker", "index": 0}})
    init_process_group(chief, "gloo", timeout=20, token="the job's secret")
    try:
        outsider = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))  # no token
        digest = outsider.get(_TOKEN.format(rank=0)).decode()
        assert digest == hashlib.sha256("the job's secret".encode()).hexdigest()[:16]
        outsider.set(_TOKEN.format(rank=1), digest)  # and may write it back as a rank of its own
        assert outsider.get(_TOKEN.format(rank=1)).decode() == digest
    finally:
        dist.destroy_process_group()
