"""The digits job's own thread runs with the intra-op threads of one CPU replica while it trains (issue 38:
with more, each tiny op between steps woke an OpenMP worker that then competed with the replicas; the
default job ran at 0.4x one device). The rule, without training."""

from __future__ import annotations

import torch

import stratagem as sg
from stratagem.demo.threads import replica_threads, threads_of_one_replica


def test_two_cpu_replicas_give_the_job_thread_one_replicas_threads_and_restore_them_after():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        assert replica_threads(strategy) == 1  # explain(): 2 threads shared by 2 CPU replicas
        with threads_of_one_replica(strategy) as threads:
            assert threads == 1 and torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        strategy.close()
        torch.set_num_threads(before)


def test_one_device_keeps_every_thread_and_an_error_restores_the_count():
    before = torch.get_num_threads()
    strategy = sg.OneDeviceStrategy("cpu")
    try:
        with threads_of_one_replica(strategy) as threads:
            assert threads == before == torch.get_num_threads()
        torch.set_num_threads(2)
        mirrored = sg.MirroredStrategy(["cpu:0", "cpu:1"])
        try:
            with threads_of_one_replica(mirrored):
                raise RuntimeError("a step failed")
        except RuntimeError:
            pass
        finally:
            mirrored.close()
        assert torch.get_num_threads() == 2
    finally:
        strategy.close()
        torch.set_num_threads(before)
