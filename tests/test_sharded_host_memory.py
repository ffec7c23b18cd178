"""ShardedStrategy(host_memory=...): what a process does with the host memory its steps free. "reuse" trains the
same parameters as "release", bit for bit, and after the first optimizer step its steps stop faulting their large
blocks in afresh; a wrong value is refused with the two choices."""

from __future__ import annotations

import pytest
import sharded_host_memory_cases
import torch
from helpers import free_port, run_ranks

from stratagem.cluster import allocator
from stratagem.errors import InputError
from stratagem.strategies.sharded import host_memory
from stratagem.strategies.sharded.host_memory import HostMemory, check_host_memory


def test_host_memory_is_release_or_reuse_and_anything_else_is_refused_with_both():
    assert check_host_memory("release") == "release"
    assert check_host_memory("reuse") == "reuse"
    with pytest.raises(InputError, match=r"Received: host_memory='fast'.*'release'.*'reuse'"):
        check_host_memory("fast")


def test_reuse_switches_once_every_optimizer_has_state(monkeypatch):
    switched: list[bool] = []
    monkeypatch.setattr(allocator, "reuse_freed_blocks_here", lambda: switched.append(True) or True)
    mapped = (True, "blocks of 64 KiB and more mapped alone")
    host = HostMemory("reuse", mapped)
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w])
    host.watch(opt)
    host.after_step()  # an evaluation step, or the first of an accumulation: no state yet
    assert not host.reusing and switched == []
    w.grad = torch.ones(3)
    opt.step()
    host.after_step()
    host.after_step()
    assert host.reusing and switched == [True]
    assert "host_memory='reuse'" in host.allocator() and "not planned" in host.allocator()
    assert host.decision().choice == "reuse"
    # "release", or a process whose mapping did not take (not glibc, the user's own setting): never switched.
    for other in (HostMemory("release", mapped), HostMemory("reuse", (False, "the user's setting kept"))):
        other.watch(opt)
        other.after_step()
        assert not other.reusing
    assert switched == [True]
    assert (
        HostMemory("reuse", (False, "the user's setting kept")).allocator()
        == "not planned for: the user's setting kept"
    )
    assert host_memory.CHOICES == ("release", "reuse")


@pytest.mark.multiprocess
@pytest.mark.sharded
@pytest.mark.skipif(allocator.GLIBC is None, reason="the mapping threshold is glibc's")
@pytest.mark.timeout(240)
def test_reuse_trains_the_same_parameters_without_the_page_faults():
    ports = [(free_port(), free_port()) for _ in range(2)]
    outcomes = run_ranks(sharded_host_memory_cases.host_memory_cases, [0, 1], args=(ports,), timeout=220)
    for outcome in outcomes.values():
        assert outcome.error is None, outcome.error
    for rank, outcome in outcomes.items():
        release, reuse = outcome.value["release"], outcome.value["reuse"]
        for a, b in zip(release["params"], reuse["params"]):
            assert a == b, rank
        # Release maps and faults in every gathered unit, gradient and buffer of 64 KiB and more each step (3 units
        # of 256 KiB weights: hundreds of pages); reuse takes them from the heap once the optimizer state exists.
        assert release["faults_per_step"] > 300, release["faults_per_step"]
        assert reuse["faults_per_step"] < release["faults_per_step"] / 5, (rank, release, reuse)
        assert "host memory freed by a step: release" in release["explain"], release["explain"]
        assert "host memory freed by a step: reuse" in reuse["explain"], reuse["explain"]
        assert "host_memory='reuse'" in reuse["allocator"] and "host_memory" not in release["allocator"]
        # The units' all-gathers and reduce-scatters are in the worker's flight record (collective/flight.py), in
        # order and ended: 3 units of one Linear each (the root holds none), one of each per step at stage 2.
        flight = reuse["flight"]
        units = [e for e in flight if e["what"] in ("all-gather of parameters", "reduce-scatter of gradients")]
        assert [e["seq"] for e in flight] == list(range(flight[0]["seq"], flight[0]["seq"] + len(flight)))
        for step in range(1, 6):  # the strategy counts steps from 0 while they run
            ops = [(e["op"], e["what"]) for e in units if e["step"] == step]
            assert ops.count(("all_gather", "all-gather of parameters")) == 3, (step, ops)
            assert ops.count(("reduce_scatter", "reduce-scatter of gradients")) == 3, (step, ops)
        assert all(e["state"] == "done" and e["transport"] == "shared memory" for e in units), units
