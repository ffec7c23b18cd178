"""Shared fixtures: deterministic torch, and device registries with N logical CPU devices."""

from __future__ import annotations

import pytest
import torch

from stratagem.devices import DeviceRegistry


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield


def cpu_registry(num_logical: int) -> DeviceRegistry:
    """A fresh registry whose CPU is split into `num_logical` logical devices."""
    registry = DeviceRegistry()
    registry.set_logical_device_configuration("cpu", num_logical)
    return registry


@pytest.fixture
def registry3() -> DeviceRegistry:
    return cpu_registry(3)
