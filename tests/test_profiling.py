"""torch.profiler sees every replica thread of MirroredStrategy when told to, and warns when it cannot."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import stratagem as sg


def _profiled_step(experimental_config: object | None) -> list[int]:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    model = strategy.distribute(torch.nn.Linear(8, 8))
    options = {} if experimental_config is None else {"experimental_config": experimental_config}
    with profile(activities=[ProfilerActivity.CPU], **options) as prof:
        strategy.step(lambda x: model(x).sum(), returns="sum")(torch.randn(4, 8))
    return [event.thread for event in prof.events() if event.name == "aten::addmm"]


def test_profile_all_threads_records_every_replica(caplog: pytest.LogCaptureFixture) -> None:
    config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    with caplog.at_level(logging.WARNING, logger="stratagem.strategies.data_parallel.profiling"):
        threads = _profiled_step(config)
    assert len(threads) == 2 and len(set(threads)) == 2  # one matmul per replica, each on its own thread
    assert not caplog.records


def test_a_profiler_of_one_thread_sees_one_replica_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="stratagem.strategies.data_parallel.profiling"):
        threads = _profiled_step(None)
    assert len(threads) == 1
    assert "sees replica 0 of 2 and none of the other replicas' threads" in caplog.text
    assert "profile_all_threads=True" in caplog.text
