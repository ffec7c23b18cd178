"""CUDA code paths whose logic a CPU can check: with mocks of torch.cuda and tensors that record their copies."""

from __future__ import annotations

import torch

from stratagem.collective.local import ReduceToOneDevice
from stratagem.devices import DeviceRegistry
from stratagem.devices.physical import PhysicalDevice
from stratagem.strategies import mirrored


class RecordsCopies(torch.Tensor):
    """A tensor that notes the non_blocking flag of every .to() called on it."""

    non_blocking: list[bool] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            cls.non_blocking.append(bool(kwargs.get("non_blocking", False)))
        return super().__torch_function__(func, types, args, kwargs)


def test_a_gradient_copied_to_the_cpu_for_the_sum_is_copied_blocking():
    # Replica 0 on the CPU, replica 1's gradient elsewhere: a non-blocking device-to-host copy would be
    # read by the CPU add before it lands. The copy towards the CPU must block.
    RecordsCopies.non_blocking = []
    target = [torch.tensor([1.0, 2.0])]
    other = [torch.tensor([10.0, 20.0]).as_subclass(RecordsCopies)]
    ReduceToOneDevice().combine_(0, [target, other], [0.5, 0.5])
    assert RecordsCopies.non_blocking == [False]
    assert target[0].tolist() == [11.0, 22.0]
    assert other[0].tolist() == [11.0, 22.0]


def test_the_nccl_probe_of_a_cpu_strategy_touches_no_gpu(monkeypatch):
    allocated_on = []
    real_zeros = torch.zeros

    def zeros(*args, **kwargs):
        allocated_on.append(str(kwargs.get("device")))
        return real_zeros(*args, **{k: v for k, v in kwargs.items() if k != "device"})

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "zeros", zeros)
    assert mirrored._nccl_available([torch.device("cpu"), torch.device("cpu")]) is False
    assert mirrored._nccl_available([torch.device("cuda", 0)]) is False  # one GPU: no all-reduce to do
    assert not any(device.startswith("cuda") for device in allocated_on)


def test_a_cpu_mirrored_strategy_builds_without_starting_cuda(monkeypatch):
    started = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: started.append("is_available") or True)
    monkeypatch.setattr(torch.cuda, "init", lambda: started.append("init"))
    registry = DeviceRegistry(physical=[PhysicalDevice(device_type="cpu", name="cpu", core_count=2)])
    strategy = mirrored.MirroredStrategy(["cpu:0", "cpu:1"], registry=registry)
    try:
        assert started == []
    finally:
        strategy.close()
