"""Logical devices: the devices strategies place replicas on, as TensorFlow's logical devices.

By default there is one logical CPU device per CPU core this process may use (``cpu:0``,
``cpu:1``, ...), all running on the one physical CPU, and one logical GPU per visible GPU. This
is what lets a multi-replica run happen on a CPU-only machine. `set_logical_device_configuration`
changes the split: more or fewer logical CPUs, or a physical GPU split into several logical GPUs
with memory limits.

The configuration lives in a `DeviceRegistry`. The module-level `default_registry` serves the
program; tests build their own with the physical devices they need. Once a strategy has
resolved devices from a registry (`resolve_devices`, `default_devices`), the configuration is
frozen: changing it then would leave that strategy's replicas on devices that no longer exist.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Sequence
from typing import Any, Union

import torch

from stratagem.devices.names import DeviceType, parse_device
from stratagem.devices.physical import PhysicalDevice, physical_devices
from stratagem.diagnose.facts import EnvironmentFacts
from stratagem.diagnose.memory import format_bytes
from stratagem.errors import DeviceConfigurationError, DeviceError


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogicalDeviceConfiguration:
    """How one logical device is carved out of its physical device.

    Example:
        >>> LogicalDeviceConfiguration(memory_limit=8 * 2**30)   # 8 GiB of a GPU
        LogicalDeviceConfiguration(memory_limit=8589934592)
    """

    memory_limit: int | None = None
    """Bytes of device memory this logical device may use (GPU only); ``None`` for no limit."""

    def __post_init__(self) -> None:
        if self.memory_limit is not None and (not isinstance(self.memory_limit, int) or self.memory_limit <= 0):
            raise DeviceError(
                f"memory_limit must be a positive number of bytes or None. "
                f"Received: memory_limit={self.memory_limit!r}. Use e.g. memory_limit=4 * 2**30 for 4 GiB."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogicalDevice:
    """A device a replica is placed on.

    Example:
        >>> registry = DeviceRegistry(physical=[PhysicalDevice(device_type="cpu", core_count=2)])
        >>> registry.get_logical_devices("cpu")[1]
        LogicalDevice(name='cpu:1', physical=device(type='cpu'), memory_limit=None)
    """

    name: str
    """Canonical torch spelling: ``"cpu:1"``, ``"cuda:0"``. Logical GPU indices run consecutively
    across physical GPUs, so with GPU 0 split in two, ``cuda:2`` runs on physical ``cuda:1``."""
    physical: torch.device
    """Where the work really runs: ``torch.device("cpu")`` for every logical CPU."""
    memory_limit: int | None = None
    """Bytes this logical device may use. A strategy enforces it where one process can
    (`enforce_memory_limits`: the only logical device on its GPU) and checks the model's estimated
    memory against it at ``distribute`` time in every case; ``explain()`` says which holds."""

    @property
    def device_type(self) -> DeviceType:
        return "cpu" if self.name.startswith("cpu") else "cuda"

    def memory_room(self, resident_bytes: int = 0) -> tuple[int, str] | None:
        """The bytes a GPU device has room for, and what that figure is: the logical device's memory
        limit, else the room on its physical GPU; None for a CPU, or a GPU torch cannot query.

        The room on a GPU is its free memory (``mem_get_info``, which counts memory this process's caching
        allocator holds as used), plus what that allocator has reserved but not handed out (cached after
        a free: it serves new tensors first), plus ``resident_bytes``: what the model already holds on
        this GPU, which the estimate counts again although no copy will be made.
        """
        if self.physical.type != "cuda":
            return None
        if self.memory_limit is not None:
            return self.memory_limit, f"the memory limit of logical device {self.name}"
        if not torch.cuda.is_available():
            return None
        free = int(torch.cuda.mem_get_info(self.physical)[0])
        cached = max(
            0, int(torch.cuda.memory_reserved(self.physical)) - int(torch.cuda.memory_allocated(self.physical))
        )
        room = free + cached + resident_bytes
        what = (
            f"the room on {self.physical} ({format_bytes(free)} free, {format_bytes(cached)} cached by this "
            f"process and unused, {format_bytes(resident_bytes)} already held by the model there)"
        )
        return room, what

    @property
    def index(self) -> int:
        return int(self.name.split(":")[1])

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "physical": str(self.physical), "memory_limit": self.memory_limit}


CpuConfigs = Union[int, Sequence[LogicalDeviceConfiguration]]


class DeviceRegistry:
    """The logical-device configuration of one program (or one test).

    Example:
        >>> registry = DeviceRegistry(physical=[PhysicalDevice(device_type="cpu", core_count=2)])
        >>> registry.set_logical_device_configuration("cpu", 4)
        >>> [d.name for d in registry.get_logical_devices()]
        ['cpu:0', 'cpu:1', 'cpu:2', 'cpu:3']
    """

    def __init__(self, physical: Sequence[PhysicalDevice] | None = None) -> None:
        """``physical``: the machine's devices; discovered on first use when not given."""
        self._physical = list(physical) if physical is not None else None
        self._num_cpus: int | None = None  # None: one logical CPU per core
        self._gpu_configs: dict[int, tuple[LogicalDeviceConfiguration, ...]] = {}
        self._used_by: str | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_facts(cls, facts: EnvironmentFacts) -> DeviceRegistry:
        """A registry over the devices `facts` describe (collected here or loaded from another machine)."""
        # Facts carry no processor name; the CPU's core count is what logical CPUs are made from.
        cpu = PhysicalDevice(device_type="cpu", name="cpu", core_count=facts.cpu_count)
        return cls(physical=[cpu] + [PhysicalDevice.from_gpu_facts(gpu) for gpu in facts.gpus])

    def physical_devices(self) -> list[PhysicalDevice]:
        with self._lock:
            if self._physical is None:
                # Names, counts and total memory only: free memory would open a CUDA context on
                # every GPU, in every process of a multi-worker job.
                self._physical = physical_devices(free_memory=False)
            return list(self._physical)

    @property
    def used_by(self) -> str | None:
        """What first resolved devices from this registry, freezing it; ``None`` while unused."""
        return self._used_by

    def mark_used(self, by: str) -> None:
        """Freezes the configuration; ``by`` names the user in later errors."""
        with self._lock:
            if self._used_by is None:
                self._used_by = by

    def set_logical_device_configuration(self, device: str | PhysicalDevice, configs: CpuConfigs) -> None:
        """Splits physical devices into logical ones. See the module-level function."""
        call = f"set_logical_device_configuration({_describe(device)}, {configs!r})"
        if self._used_by is not None:
            raise DeviceConfigurationError(
                f"Logical devices cannot be changed after a strategy has used them (first used by "
                f"{self._used_by}). Received: {call}. Call it at the start of the program, before "
                "building any strategy."
            )
        device_type, index = _physical_target(device, call)
        if device_type == "cpu":
            num_cpus = _num_cpus(configs, call)
            with self._lock:
                self._num_cpus = num_cpus
            return
        gpus = [d for d in self.physical_devices() if d.device_type == "cuda"]
        targets = gpus if index is None else [d for d in gpus if d.index == index]
        if not targets:
            have = f"cuda:0..cuda:{len(gpus) - 1}" if gpus else "none; run `stratagem doctor` to see why"
            raise DeviceError(f"There is no physical GPU to configure. Received: {call}. Physical GPUs: {have}.")
        gpu_configs = _gpu_configs(configs, call)
        for gpu in targets:
            _check_fits(gpu, gpu_configs, call)
        with self._lock:
            for gpu in targets:
                self._gpu_configs[_gpu_index(gpu)] = gpu_configs

    def get_logical_devices(self, device_type: str | None = None) -> list[LogicalDevice]:
        """Logical CPUs then logical GPUs; ``device_type`` ``"cpu"`` or ``"cuda"``/``"gpu"`` filters."""
        wanted = _device_type_filter(device_type)
        physical = self.physical_devices()
        devices: list[LogicalDevice] = []
        if wanted in (None, "cpu"):
            cores = next((d.core_count for d in physical if d.device_type == "cpu"), None) or 1
            num_cpus = self._num_cpus if self._num_cpus is not None else cores
            devices += [LogicalDevice(name=f"cpu:{i}", physical=torch.device("cpu")) for i in range(num_cpus)]
        if wanted in (None, "cuda"):
            gpus = sorted((d for d in physical if d.device_type == "cuda"), key=_gpu_index)
            for gpu in gpus:
                for config in self._gpu_configs.get(_gpu_index(gpu), (LogicalDeviceConfiguration(),)):
                    devices.append(
                        LogicalDevice(
                            name=f"cuda:{sum(d.device_type == 'cuda' for d in devices)}",
                            physical=torch.device("cuda", _gpu_index(gpu)),
                            memory_limit=config.memory_limit,
                        )
                    )
        return devices


default_registry = DeviceRegistry()
"""The registry of this program; discovers the machine's devices on first use."""


def set_logical_device_configuration(
    device: str | PhysicalDevice, configs: CpuConfigs, *, registry: DeviceRegistry | None = None
) -> None:
    """Sets how physical devices are split into logical devices. Call it before building a strategy.

    ``device`` is ``"cpu"``; ``"cuda"`` (or ``"gpu"``) for every physical GPU; one GPU
    (``"cuda:1"``, ``"/gpu:1"``, a `PhysicalDevice`). ``configs`` is, for the CPU, the number of
    logical CPUs (or a list of `LogicalDeviceConfiguration`, one per logical CPU); for a GPU, a
    list of `LogicalDeviceConfiguration`, one per logical GPU carved out of each physical GPU.

    Example:
        >>> import stratagem as sg
        >>> registry = sg.devices.DeviceRegistry()       # or leave registry out: the program's own
        >>> sg.devices.set_logical_device_configuration("cpu", 4, registry=registry)
        >>> [d.name for d in sg.devices.get_logical_devices("cpu", registry=registry)]
        ['cpu:0', 'cpu:1', 'cpu:2', 'cpu:3']

        On a GPU machine, ``set_logical_device_configuration("cuda",
        [LogicalDeviceConfiguration(memory_limit=20 * 2**30)] * 2)`` makes two 20 GiB logical
        GPUs of each physical GPU.

    Raises:
        DeviceConfigurationError: a strategy already used the registry's devices.
        DeviceError: the device or the configuration is invalid.
    """
    (registry or default_registry).set_logical_device_configuration(device, configs)


def get_logical_devices(
    device_type: str | None = None, *, registry: DeviceRegistry | None = None
) -> list[LogicalDevice]:
    """The logical devices, CPUs first; ``device_type`` ``"cpu"`` or ``"cuda"``/``"gpu"`` filters.

    Example:
        >>> [d.name for d in get_logical_devices("cpu")]    # on a 2-core machine
        ['cpu:0', 'cpu:1']
    """
    return (registry or default_registry).get_logical_devices(device_type)


def _describe(device: str | PhysicalDevice) -> str:
    return repr(device.torch_name) if isinstance(device, PhysicalDevice) else repr(device)


def _physical_target(device: str | PhysicalDevice, call: str) -> tuple[DeviceType, int | None]:
    if isinstance(device, PhysicalDevice):
        return device.device_type, device.index
    if isinstance(device, str) and device.strip().lower() == "gpu":
        return "cuda", None
    spec = parse_device(device)
    if spec.is_qualified:
        raise DeviceError(
            f"Logical devices can only be configured on this machine's physical devices. Received: {call}. "
            "Drop the /job:.../task:... prefix and call it on the task that owns the device."
        )
    if spec.device_type == "cpu" and spec.index not in (None, 0):
        raise DeviceError(
            f"A machine has one physical CPU device, 'cpu'. Received: {call}. "
            "Use set_logical_device_configuration('cpu', N) for N logical CPUs."
        )
    return spec.device_type, (None if spec.device_type == "cpu" else spec.index)


def _num_cpus(configs: CpuConfigs, call: str) -> int:
    if isinstance(configs, int) and not isinstance(configs, bool):
        count = configs
    elif isinstance(configs, Sequence) and all(isinstance(c, LogicalDeviceConfiguration) for c in configs):
        if any(c.memory_limit is not None for c in configs):
            raise DeviceError(
                f"Logical CPU devices share the host's memory and take no memory_limit. Received: {call}. "
                "Use LogicalDeviceConfiguration() or a count."
            )
        count = len(configs)
    else:
        raise DeviceError(
            f"The CPU configuration must be a count or a list of LogicalDeviceConfiguration. "
            f"Received: {call}. Use e.g. set_logical_device_configuration('cpu', 4)."
        )
    if count < 1:
        raise DeviceError(
            f"There must be at least one logical CPU device. Received: {call}. "
            "Use a count >= 1, e.g. set_logical_device_configuration('cpu', 2)."
        )
    return count


def _gpu_configs(configs: CpuConfigs, call: str) -> tuple[LogicalDeviceConfiguration, ...]:
    if (
        isinstance(configs, (int, str))
        or not isinstance(configs, Sequence)
        or not configs
        or not all(isinstance(c, LogicalDeviceConfiguration) for c in configs)
    ):
        raise DeviceError(
            f"A GPU configuration is a non-empty list of LogicalDeviceConfiguration, one per logical GPU. "
            f"Received: {call}. Use e.g. [LogicalDeviceConfiguration(memory_limit=8 * 2**30)] * 2 "
            "for two 8 GiB logical GPUs."
        )
    return tuple(configs)


def _gpu_index(gpu: PhysicalDevice) -> int:
    """The CUDA index of a physical GPU (only the CPU has none: GPUs are made from GpuFacts, which always have one)."""
    assert gpu.index is not None, gpu
    return gpu.index


def _check_fits(gpu: PhysicalDevice, configs: Sequence[LogicalDeviceConfiguration], call: str) -> None:
    limited = sum(c.memory_limit or 0 for c in configs)
    if gpu.total_memory is not None and limited > gpu.total_memory:
        raise DeviceError(
            f"The memory limits add up to {format_bytes(limited)}, more than the "
            f"{format_bytes(gpu.total_memory)} of {gpu.torch_name} ({gpu.name}). Received: {call}. "
            "Lower the limits or create fewer logical GPUs."
        )


def _device_type_filter(device_type: str | None) -> DeviceType | None:
    if device_type is None:
        return None
    normalized = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}.get(device_type.lower())
    if normalized is None:
        raise DeviceError(
            f"Unknown device type. Received: device_type={device_type!r}. Use 'cpu', 'cuda' (or 'gpu') or None."
        )
    return normalized  # type: ignore[return-value]


def resident_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes of the distinct tensors (storage counted once) that already live on ``device``."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if tensor.device != device:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def enforce_memory_limits(devices: Sequence[LogicalDevice]) -> list[tuple[str, str]]:
    """Makes the memory limits of these logical GPUs real where one process can, and says what holds.

    One logical device on a physical GPU: ``torch.cuda.set_per_process_memory_fraction(limit / total)``
    caps this process's caching allocator there, so an allocation past the limit raises
    ``torch.OutOfMemoryError``. Several logical devices on one GPU share this process's one allocator
    for it: their summed limits are enforced together (when every one has a limit), while each one's
    own limit is a planning figure, checked against the model's estimated memory at ``distribute``.
    Returns (choice, reason) per physical GPU that has a limit.
    """
    by_gpu: dict[int, list[LogicalDevice]] = {}
    for device in devices:
        if device.physical.type == "cuda":
            by_gpu.setdefault(device.physical.index or 0, []).append(device)
    outcomes = []
    for index, logical in sorted(by_gpu.items()):
        limits = [d.memory_limit for d in logical]
        if all(limit is None for limit in limits):
            continue
        names = ", ".join(d.name for d in logical)
        if any(limit is None for limit in limits):
            outcomes.append(
                (
                    f"planning figure on cuda:{index}",
                    (
                        f"{names} share cuda:{index} and not all have a memory limit, so nothing caps this process there; "
                        "each limit is checked against the model's estimated memory at distribute()"
                    ),
                )
            )
            continue
        if not torch.cuda.is_available():
            # Devices described by facts (another machine's, or a test's): there is no allocator to cap here.
            outcomes.append(
                (
                    f"planning figure on cuda:{index}",
                    (
                        f"CUDA is not available in this process, so nothing caps {names}; each limit is checked against "
                        "the model's estimated memory at distribute()"
                    ),
                )
            )
            continue
        total = int(torch.cuda.get_device_properties(index).total_memory)
        capped = sum(limits)  # type: ignore[arg-type]
        torch.cuda.set_per_process_memory_fraction(min(1.0, capped / total), index)
        if len(logical) == 1:
            outcomes.append(
                (
                    f"enforced on cuda:{index}",
                    (
                        f"{names} is the only logical device on cuda:{index}: this process's allocator there is capped at "
                        f"{format_bytes(capped)} of {format_bytes(total)} (torch.cuda.set_per_process_memory_fraction), "
                        "so allocating past it raises torch.OutOfMemoryError"
                    ),
                )
            )
        else:
            outcomes.append(
                (
                    f"summed limit enforced on cuda:{index}",
                    (
                        f"{names} share cuda:{index} and one allocator: their limits together ({format_bytes(capped)}) cap "
                        "this process there (torch.cuda.set_per_process_memory_fraction); each device's own limit is a "
                        "planning figure, checked against the model's estimated memory at distribute()"
                    ),
                )
            )
    return outcomes
