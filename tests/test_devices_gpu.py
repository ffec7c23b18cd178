"""The real CUDA paths of discovery and diagnosis; skipped on machines without a GPU.

The full report is `tests/gpu/check_cuda.py`; these are its core assertions under pytest.
"""

from __future__ import annotations

import pytest
import torch

from stratagem.devices import DeviceRegistry, default_devices, physical_devices, resolve_devices
from stratagem.diagnose import check_environment, collect_facts, estimate_training_memory

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; torch.cuda.is_available() is False"),
]


def test_physical_gpus_have_name_memory_and_capability():
    gpus = [d for d in physical_devices() if d.device_type == "cuda"]
    assert len(gpus) == torch.cuda.device_count()
    for gpu in gpus:
        assert gpu.name == torch.cuda.get_device_name(gpu.index)
        assert 0 < gpu.free_memory <= gpu.total_memory
        assert gpu.capability == torch.cuda.get_device_capability(gpu.index)


def test_facts_and_checks_on_a_gpu_machine():
    facts = collect_facts({})
    assert facts.is_cuda_build and facts.driver_present
    assert facts.torch_device_count == torch.cuda.device_count() == len(facts.gpus)
    assert [c for c in check_environment(facts) if c.verdict == "problem"] == []


def test_default_devices_are_every_gpu():
    devices, decision = default_devices(DeviceRegistry())
    assert [d.name for d in devices] == [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    assert decision.reason.startswith("every visible GPU")
    assert resolve_devices(["/gpu:0"], DeviceRegistry())[0].physical == torch.device("cuda", 0)


def test_memory_estimate_is_a_lower_bound_of_allocation():
    base = torch.cuda.memory_allocated(0)
    model = torch.nn.Linear(1024, 1024).cuda(0)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 1024, device="cuda:0")).sum().backward()
    optimizer.step()
    assert estimate_training_memory(model, optimizer).total_bytes <= torch.cuda.memory_allocated(0) - base
