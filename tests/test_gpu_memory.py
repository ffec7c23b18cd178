"""GPU memory limits and the room check, with torch.cuda's memory functions mocked (no GPU needed)."""

from __future__ import annotations

import types

import pytest
import torch

import stratagem as sg
from stratagem.devices import (
    DeviceRegistry,
    LogicalDevice,
    LogicalDeviceConfiguration,
    enforce_memory_limits,
    resident_bytes,
)
from stratagem.devices.physical import PhysicalDevice
from stratagem.errors import MemoryEstimateError
from stratagem.strategies import mirrored
from stratagem.strategies.data_parallel.placement import check_memory

GiB = 2**30


@pytest.fixture
def gpu_memory(monkeypatch):
    """cuda:0 with 80 GiB; `free` free on the GPU, `reserved` held by this process's allocator, `allocated` in use."""

    def install(*, free: int, reserved: int, allocated: int) -> list[tuple[float, int]]:
        fractions: list[tuple[float, int]] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GiB))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
        monkeypatch.setattr(
            torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(total_memory=80 * GiB)
        )
        monkeypatch.setattr(
            torch.cuda,
            "set_per_process_memory_fraction",
            lambda fraction, device=None: fractions.append((fraction, device)),
        )
        return fractions

    return install


def gpu_registry() -> DeviceRegistry:
    return DeviceRegistry(
        physical=[
            PhysicalDevice(device_type="cpu", name="cpu", core_count=2),
            PhysicalDevice(device_type="cuda", index=0, name="H200", total_memory=80 * GiB),
        ]
    )


def test_the_room_counts_memory_the_allocator_cached_and_what_the_model_already_holds(gpu_memory):
    gpu_memory(free=1 * GiB, reserved=5 * GiB, allocated=2 * GiB)
    device = LogicalDevice(name="cuda:0", physical=torch.device("cuda", 0))
    room, what = device.memory_room(resident_bytes=GiB)
    assert room == 1 * GiB + 3 * GiB + 1 * GiB
    assert what == (
        "the room on cuda:0 (1.00 GiB free, 3.00 GiB cached by this process and unused, "
        "1.00 GiB already held by the model there)"
    )


def test_a_model_that_fits_in_cached_memory_is_not_refused(gpu_memory, monkeypatch):
    # 300M float32 parameters with SGD: at least 2.2 GiB (parameters and gradients). 1 GiB is free on the GPU,
    # but this process's allocator holds 3 GiB more that it freed, which a new tensor reuses.
    gpu_memory(free=1 * GiB, reserved=5 * GiB, allocated=2 * GiB)
    big = sg.diagnose.MemoryEstimate(
        parameter_bytes=300_000_000 * 4, gradient_bytes=300_000_000 * 4, optimizer_state_bytes=0, optimizer="SGD"
    )
    monkeypatch.setattr(mirrored.diagnose, "estimate_training_memory", lambda *args, **kwargs: big)
    strategy = mirrored.MirroredStrategy(["cuda:0"], registry=gpu_registry())
    try:
        check_memory(strategy._replicas.placement.logical, torch.nn.Linear(1, 1), None)
    finally:
        strategy.close()


def test_a_model_that_does_not_fit_is_refused_with_the_figures(gpu_memory, monkeypatch):
    gpu_memory(free=1 * GiB, reserved=1 * GiB, allocated=1 * GiB)
    big = sg.diagnose.MemoryEstimate(
        parameter_bytes=2 * GiB, gradient_bytes=2 * GiB, optimizer_state_bytes=0, optimizer="SGD"
    )
    monkeypatch.setattr(mirrored.diagnose, "estimate_training_memory", lambda *args, **kwargs: big)
    strategy = mirrored.MirroredStrategy(["cuda:0"], registry=gpu_registry())
    try:
        with pytest.raises(
            MemoryEstimateError,
            match=r"Replica on cuda:0 needs at least .* but the room on cuda:0 "
            r"\(1\.00 GiB free, 0 B cached",
        ):
            check_memory(strategy._replicas.placement.logical, torch.nn.Linear(1, 1), None)
        # What the model already holds on the first replica's GPU is no new memory.
        monkeypatch.setattr(mirrored.sg_devices, "resident_bytes", lambda tensors, device: 4 * GiB)
        check_memory(strategy._replicas.placement.logical, torch.nn.Linear(1, 1), None)
    finally:
        strategy.close()


def test_resident_bytes_counts_each_storage_once_and_only_on_its_device():
    weight = torch.zeros(256)  # 1 KiB
    view = weight[:128]
    assert resident_bytes([weight, view, torch.zeros(4)], torch.device("cpu")) == 1024 + 16
    assert resident_bytes([weight], torch.device("cuda", 0)) == 0


def test_the_only_logical_device_on_a_gpu_gets_its_limit_enforced(gpu_memory):
    fractions = gpu_memory(free=80 * GiB, reserved=0, allocated=0)
    device = LogicalDevice(name="cuda:0", physical=torch.device("cuda", 0), memory_limit=20 * GiB)
    [(choice, why)] = enforce_memory_limits([device])
    assert fractions == [(0.25, 0)]
    assert choice == "enforced on cuda:0" and "capped at 20.00 GiB of 80.00 GiB" in why


def test_logical_devices_sharing_a_gpu_have_their_sum_enforced_and_each_limit_planned(gpu_memory):
    fractions = gpu_memory(free=80 * GiB, reserved=0, allocated=0)
    devices = [LogicalDevice(name=f"cuda:{i}", physical=torch.device("cuda", 0), memory_limit=20 * GiB) for i in (0, 1)]
    [(choice, why)] = enforce_memory_limits(devices)
    assert fractions == [(0.5, 0)]
    assert choice == "summed limit enforced on cuda:0" and "each device's own limit is a planning figure" in why
    devices[1] = LogicalDevice(name="cuda:1", physical=torch.device("cuda", 0))
    [(choice, _)] = enforce_memory_limits(devices)
    assert choice == "planning figure on cuda:0" and fractions == [(0.5, 0)]  # no new cap


def test_explain_says_whether_a_memory_limit_is_enforced(gpu_memory):
    fractions = gpu_memory(free=80 * GiB, reserved=0, allocated=0)
    registry = gpu_registry()
    registry.set_logical_device_configuration("cuda:0", [LogicalDeviceConfiguration(memory_limit=40 * GiB)])
    strategy = mirrored.MirroredStrategy(["cuda:0"], registry=registry)
    try:
        decision = next(d for d in strategy.explain().decisions if d.subject == "GPU memory limit")
        assert decision.choice == "enforced on cuda:0" and fractions == [(0.5, 0)]
    finally:
        strategy.close()
