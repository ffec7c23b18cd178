"""Shared fixtures: deterministic torch, and device registries with N logical CPU devices."""

from __future__ import annotations

import pytest
import torch

from stratagem.devices import DeviceRegistry


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A test that leaves torch.distributed initialized would break every later rendezvous test: fail it."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("this test left torch.distributed initialized; close the strategy (strategy.close())")


def cpu_registry(num_logical: int) -> DeviceRegistry:
    """A fresh registry whose CPU is split into `num_logical` logical devices."""
    registry = DeviceRegistry()
    registry.set_logical_device_configuration("cpu", num_logical)
    return registry


@pytest.fixture
def registry3() -> DeviceRegistry:
    return cpu_registry(3)
