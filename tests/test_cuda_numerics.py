"""TF32 stated by explain(), a random stream per GPU replica, CUDA RNG states restored on another GPU count.

No GPU: the TF32 switches are torch's own (readable on any build), the per-device seeding and the
CUDA RNG calls are recorded by mocks.
"""

from __future__ import annotations

import logging

import pytest
import torch

from stratagem.devices import DeviceRegistry
from stratagem.devices.physical import PhysicalDevice
from stratagem.strategies import mirrored
from stratagem.strategies.data_parallel import cuda_numerics
from stratagem.strategies.data_parallel.cuda_numerics import replica_seed, seed_replica_streams, tf32_decision
from stratagem.train import checkpoint

CUDA = [torch.device("cuda", i) for i in range(3)]


@pytest.fixture
def tf32():
    # torch's switches are module properties backed by C++, not attributes monkeypatch can restore.
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)

    def set_flags(matmul: bool, conv: bool) -> None:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = conv

    yield set_flags
    set_flags(*before)


def test_tf32_is_stated_for_gpu_replicas_with_its_consequence(tf32):
    tf32(False, True)  # torch's defaults: matmuls off, cuDNN convolutions on
    decision = tf32_decision(CUDA[:1])
    assert decision.choice == "matmul off, cuDNN convolutions on"
    assert "differ from one device by more than 1e-5" in decision.reason
    tf32(False, False)
    assert "match one device to 1e-5" in tf32_decision(CUDA[:1]).reason
    assert tf32_decision([torch.device("cpu")]) is None


def test_explain_of_a_gpu_strategy_says_whether_tf32_is_on(tf32):
    tf32(True, True)
    registry = DeviceRegistry(
        physical=[
            PhysicalDevice(device_type="cpu", name="cpu", core_count=2),
            PhysicalDevice(device_type="cuda", index=0, name="H200", total_memory=2**37),
        ]
    )
    strategy = mirrored.MirroredStrategy(["cuda:0"], registry=registry)
    try:
        assert strategy.explain().decision("TF32").choice == "matmul on, cuDNN convolutions on"
    finally:
        strategy.close()


def test_each_gpu_replica_but_the_first_gets_a_distinct_reproducible_seed():
    torch.manual_seed(1234)
    calls: list[tuple[int, int]] = []
    decision = seed_replica_streams(CUDA, 0, seed_device=lambda index, seed: calls.append((index, seed)))
    assert calls == [(1, replica_seed(1234, 1)), (2, replica_seed(1234, 2))]
    assert len({1234, *(seed for _, seed in calls)}) == 3
    assert decision.choice == "one per replica"
    # Rank 1 of a multi-worker job with three GPUs each: global replicas 3, 4, 5, every GPU reseeded.
    calls.clear()
    seed_replica_streams(CUDA, 3, seed_device=lambda index, seed: calls.append((index, seed)))
    assert calls == [(0, replica_seed(1234, 3)), (1, replica_seed(1234, 4)), (2, replica_seed(1234, 5))]


def test_replicas_sharing_a_gpu_are_told_their_stream_is_shared():
    calls = []
    decision = seed_replica_streams([CUDA[0], CUDA[0]], 0, seed_device=lambda *a: calls.append(a))
    assert calls == [] and decision.choice == "shared per GPU"
    assert seed_replica_streams([torch.device("cpu")], 0) is None


def test_distribute_seeds_the_streams_from_this_process_first_global_replica(monkeypatch):
    seen = []
    monkeypatch.setattr(cuda_numerics, "seed_replica_streams", lambda devices, first: seen.append((devices, first)))
    registry = DeviceRegistry(physical=[PhysicalDevice(device_type="cpu", name="cpu", core_count=2)])
    strategy = mirrored.MirroredStrategy(["cpu:0", "cpu:1"], registry=registry)
    try:
        net = torch.nn.Linear(2, 2)
        strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1))
        assert seen == [([torch.device("cpu")] * 2, 0)]
    finally:
        strategy.close()


@pytest.mark.parametrize("saved, visible, restored", [(2, 1, [0]), (1, 2, [0]), (2, 2, [0, 1])])
def test_cuda_rng_states_are_restored_on_a_machine_with_another_gpu_count(
    monkeypatch, caplog, saved, visible, restored
):
    calls = []

    def set_rng_state(state, device):
        if device >= visible:
            raise RuntimeError(f"CUDA error: invalid device ordinal {device}")
        calls.append(device)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    state = checkpoint.capture_rng_state()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8) for _ in range(saved)]
    with caplog.at_level(logging.WARNING, logger="stratagem.train.checkpoint"):
        checkpoint.restore_rng_state(state)
    assert calls == restored
    assert ("random states for" in caplog.text) == (saved != visible)
