"""The physical devices of this machine: its CPU and the CUDA GPUs torch can see."""

from __future__ import annotations

import dataclasses
import platform
from typing import Any

import torch

from stratagem.devices.names import DeviceType
from stratagem.diagnose.facts import GpuFacts, cpu_count, probe_gpus


@dataclasses.dataclass(frozen=True, kw_only=True)
class PhysicalDevice:
    """One physical device. A machine has one CPU device, however many cores it has.

    Example:
        >>> cpu = physical_devices()[0]
        >>> cpu.device_type, cpu.torch_name
        ('cpu', 'cpu')
    """

    device_type: DeviceType
    index: int | None = None
    """The CUDA index torch uses; ``None`` for the CPU."""
    name: str = ""
    """``"NVIDIA H100 80GB HBM3"``, or the CPU's processor name."""
    core_count: int | None = None
    """CPU cores this process may run on; ``None`` for a GPU."""
    total_memory: int | None = None
    """Bytes of device memory (GPU only)."""
    free_memory: int | None = None
    """Bytes free when discovered (GPU only)."""
    capability: tuple[int, int] | None = None
    """CUDA compute capability (GPU only)."""

    @property
    def torch_name(self) -> str:
        return "cpu" if self.device_type == "cpu" else f"cuda:{self.index}"

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device_type, self.index)  # type: ignore[arg-type]  # torch takes index None; its stubs say int

    @classmethod
    def from_gpu_facts(cls, gpu: GpuFacts) -> PhysicalDevice:
        return cls(
            device_type="cuda",
            index=gpu.index,
            name=gpu.name,
            total_memory=gpu.total_memory,
            free_memory=gpu.free_memory,
            capability=gpu.capability,
        )

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "torch_name": self.torch_name}


def physical_devices(*, free_memory: bool = True) -> list[PhysicalDevice]:
    """The CPU, then each CUDA GPU torch can see (with name, memory and capability).

    With a CPU-only torch build no CUDA call is made. With a CUDA build, reading free memory
    creates a CUDA context on each GPU; ``free_memory=False`` skips it (and leaves
    ``free_memory`` None), as a process that will use only some GPUs should.

    Example:
        >>> [d.torch_name for d in physical_devices()][:1]
        ['cpu']
    """
    cpu = PhysicalDevice(device_type="cpu", name=platform.processor() or platform.machine(), core_count=cpu_count())
    gpus = probe_gpus(free_memory=free_memory)
    return [cpu] + [PhysicalDevice.from_gpu_facts(gpu) for gpu in gpus]
