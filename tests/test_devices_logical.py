"""Logical devices, device-list resolution and the default placement, on constructed machines."""

from __future__ import annotations

import pytest
import torch

from stratagem.devices import (
    DeviceRegistry,
    LogicalDevice,
    LogicalDeviceConfiguration,
    PhysicalDevice,
    default_devices,
    get_logical_devices,
    resolve_devices,
    set_logical_device_configuration,
)
from stratagem.diagnose import EnvironmentFacts, GpuFacts
from stratagem.errors import DeviceConfigurationError, DeviceError

GiB = 2**30
CPU2 = PhysicalDevice(device_type="cpu", name="test cpu", core_count=2)


def gpu(index: int, total: int = 16 * GiB) -> PhysicalDevice:
    return PhysicalDevice(
        device_type="cuda", index=index, name="Test GPU", total_memory=total, free_memory=total, capability=(8, 0)
    )


def machine(num_gpus: int = 0) -> DeviceRegistry:
    return DeviceRegistry(physical=[CPU2] + [gpu(i) for i in range(num_gpus)])


CPU_ONLY_FACTS = EnvironmentFacts(torch_version="2.13.0+cpu", cpu_count=2)


def names(devices: list[LogicalDevice]) -> list[str]:
    return [device.name for device in devices]


# ---- logical devices ----------------------------------------------------------------------------


def test_one_logical_cpu_per_core_and_one_logical_gpu_per_gpu():
    devices = machine(num_gpus=2).get_logical_devices()
    assert devices == [
        LogicalDevice(name="cpu:0", physical=torch.device("cpu")),
        LogicalDevice(name="cpu:1", physical=torch.device("cpu")),
        LogicalDevice(name="cuda:0", physical=torch.device("cuda", 0)),
        LogicalDevice(name="cuda:1", physical=torch.device("cuda", 1)),
    ]


def test_filter_by_type():
    registry = machine(num_gpus=1)
    assert names(registry.get_logical_devices("CPU")) == ["cpu:0", "cpu:1"]
    assert names(registry.get_logical_devices("gpu")) == ["cuda:0"]
    assert names(get_logical_devices("cuda", registry=registry)) == ["cuda:0"]
    with pytest.raises(DeviceError, match=r"Received: device_type='tpu'\. Use 'cpu', 'cuda'"):
        registry.get_logical_devices("tpu")


def test_set_logical_cpus_by_count_and_by_configs():
    registry = machine()
    set_logical_device_configuration("cpu", 3, registry=registry)
    assert names(registry.get_logical_devices()) == ["cpu:0", "cpu:1", "cpu:2"]
    registry.set_logical_device_configuration("/cpu:0", [LogicalDeviceConfiguration()] * 4)
    assert names(registry.get_logical_devices()) == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert {d.physical for d in registry.get_logical_devices()} == {torch.device("cpu")}


def test_split_gpus_numbers_logical_gpus_consecutively():
    registry = machine(num_gpus=2)
    registry.set_logical_device_configuration("cuda:0", [LogicalDeviceConfiguration(memory_limit=4 * GiB)] * 2)
    assert registry.get_logical_devices("cuda") == [
        LogicalDevice(name="cuda:0", physical=torch.device("cuda", 0), memory_limit=4 * GiB),
        LogicalDevice(name="cuda:1", physical=torch.device("cuda", 0), memory_limit=4 * GiB),
        LogicalDevice(name="cuda:2", physical=torch.device("cuda", 1)),
    ]


def test_split_every_gpu():
    registry = machine(num_gpus=2)
    registry.set_logical_device_configuration("gpu", [LogicalDeviceConfiguration()] * 2)
    assert [(d.name, d.physical.index) for d in registry.get_logical_devices("cuda")] == [
        ("cuda:0", 0),
        ("cuda:1", 0),
        ("cuda:2", 1),
        ("cuda:3", 1),
    ]


def test_split_by_physical_device_object():
    registry = machine(num_gpus=2)
    physical_gpu1 = registry.physical_devices()[2]
    registry.set_logical_device_configuration(physical_gpu1, [LogicalDeviceConfiguration()] * 2)
    assert [(d.name, d.physical.index) for d in registry.get_logical_devices("cuda")] == [
        ("cuda:0", 0),
        ("cuda:1", 1),
        ("cuda:2", 1),
    ]


def test_memory_limits_larger_than_the_gpu():
    registry = machine(num_gpus=1)
    with pytest.raises(
        DeviceError,
        match=r"add up to 20\.00 GiB, more than the 16\.00 GiB of cuda:0 \(Test GPU\)"
        r"\. Received: set_logical_device_configuration\('cuda'",
    ):
        registry.set_logical_device_configuration("cuda", [LogicalDeviceConfiguration(memory_limit=10 * GiB)] * 2)


@pytest.mark.parametrize("limit", [0, -5, 1.5])
def test_bad_memory_limit(limit):
    with pytest.raises(DeviceError, match=rf"Received: memory_limit={limit}\. Use e\.g\. memory_limit="):
        LogicalDeviceConfiguration(memory_limit=limit)


def test_cpu_configuration_errors():
    registry = machine()
    with pytest.raises(
        DeviceError, match=r"at least one logical CPU.*Received: set_logical_device_configuration\('cpu', 0\)"
    ):
        registry.set_logical_device_configuration("cpu", 0)
    with pytest.raises(DeviceError, match=r"take no memory_limit\. Received:"):
        registry.set_logical_device_configuration("cpu", [LogicalDeviceConfiguration(memory_limit=GiB)])
    with pytest.raises(
        DeviceError,
        match=r"a count or a list of LogicalDeviceConfiguration\. Received: "
        r"set_logical_device_configuration\('cpu', 'two'\)",
    ):
        registry.set_logical_device_configuration("cpu", "two")
    with pytest.raises(
        DeviceError, match=r"one physical CPU device.*Received: set_logical_device_configuration\('cpu:1', 2\)"
    ):
        registry.set_logical_device_configuration("cpu:1", 2)
    with pytest.raises(
        DeviceError,
        match=r"this machine's physical devices\. Received: "
        r"set_logical_device_configuration\('/job:worker/task:1/cpu:0', 2\)",
    ):
        registry.set_logical_device_configuration("/job:worker/task:1/cpu:0", 2)


def test_gpu_configuration_errors():
    registry = machine(num_gpus=1)
    with pytest.raises(
        DeviceError,
        match=r"non-empty list of LogicalDeviceConfiguration.*Received: "
        r"set_logical_device_configuration\('cuda', 2\)",
    ):
        registry.set_logical_device_configuration("cuda", 2)
    with pytest.raises(
        DeviceError,
        match=r"no physical GPU to configure\. Received: "
        r"set_logical_device_configuration\('cuda:3', .*Physical GPUs: cuda:0\.\.cuda:0",
    ):
        registry.set_logical_device_configuration("cuda:3", [LogicalDeviceConfiguration()])
    with pytest.raises(DeviceError, match=r"Physical GPUs: none; run `stratagem doctor`"):
        machine().set_logical_device_configuration("cuda", [LogicalDeviceConfiguration()])


def test_configuration_is_frozen_once_a_strategy_resolved_devices():
    registry = machine()
    registry.get_logical_devices()  # looking is allowed before configuring
    registry.set_logical_device_configuration("cpu", 3)
    resolve_devices(["cpu:0", "cpu:2"], registry)
    assert registry.used_by == "resolve_devices(['cpu:0', 'cpu:2'])"
    with pytest.raises(
        DeviceConfigurationError,
        match=r"cannot be changed after a strategy has used them \(first used by "
        r"resolve_devices\(\['cpu:0', 'cpu:2'\]\)\)\. Received: "
        r"set_logical_device_configuration\('cpu', 4\)\. Call it at the start",
    ):
        registry.set_logical_device_configuration("cpu", 4)


def test_default_devices_freezes_too():
    registry = machine()
    default_devices(registry, CPU_ONLY_FACTS)
    with pytest.raises(DeviceConfigurationError, match=r"first used by default_devices\(\) -> \['cpu:0'\]"):
        registry.set_logical_device_configuration("cpu", 4)


def test_registry_from_facts():
    facts = EnvironmentFacts(
        torch_version="2.4.0+cu124",
        torch_cuda_version="12.4",
        cpu_count=3,
        torch_device_count=1,
        gpus=[GpuFacts(index=0, name="Test GPU", total_memory=8 * GiB, free_memory=GiB, capability=(9, 0))],
    )
    registry = DeviceRegistry.from_facts(facts)
    assert names(registry.get_logical_devices()) == ["cpu:0", "cpu:1", "cpu:2", "cuda:0"]
    assert registry.physical_devices()[1].free_memory == GiB


def test_default_registry_discovers_this_machine():
    # A fresh registry, not the module default, so no test freezes the program's registry.
    devices = DeviceRegistry().get_logical_devices("cpu")
    assert len(devices) >= 1 and devices[0].name == "cpu:0"


# ---- resolve_devices ----------------------------------------------------------------------------


def test_resolve_mixed_spellings_in_order():
    registry = machine(num_gpus=2)
    assert names(resolve_devices(["/gpu:1", "cuda:0", "/device:CPU:1", "cpu"], registry)) == [
        "cuda:1",
        "cuda:0",
        "cpu:1",
        "cpu:0",
    ]


def test_resolve_bare_type_means_index_zero():
    registry = machine(num_gpus=1)
    assert names(resolve_devices(["cuda", torch.device("cpu")], registry)) == ["cuda:0", "cpu:0"]


def test_resolve_local_qualified_names():
    registry = machine(num_gpus=1)
    assert names(resolve_devices(["/job:localhost/replica:0/task:0/device:GPU:0"], registry)) == ["cuda:0"]
    assert names(resolve_devices(["/job:worker/task:1/device:CPU:0"], registry, local_task=("worker", 1))) == ["cpu:0"]


def test_resolve_out_of_range_cpu():
    with pytest.raises(
        DeviceError,
        match=r"^Device 'cpu:5' is out of range: this machine has 2 logical CPU devices "
        r"\(cpu:0\.\.cpu:1\)\. Use one of cpu:0\.\.cpu:1, or call "
        r"sg\.devices\.set_logical_device_configuration\('cpu', 6\)\.$",
    ):
        resolve_devices(["cpu:0", "cpu:5"], machine())


def test_resolve_out_of_range_gpu():
    with pytest.raises(
        DeviceError,
        match=r"^Device '/gpu:2' is out of range: this machine has 2 logical GPU devices "
        r"\(cuda:0\.\.cuda:1\)\. Use one of cuda:0\.\.cuda:1, check CUDA_VISIBLE_DEVICES",
    ):
        resolve_devices(["/gpu:2"], machine(num_gpus=2))


def test_resolve_duplicates():
    with pytest.raises(
        DeviceError,
        match=r"Devices 'cuda:0' and '/gpu:0' both denote the logical device cuda:0\. "
        r"Received: devices=\['cuda:0', '/gpu:0'\]\. List each device once",
    ):
        resolve_devices(["cuda:0", "/gpu:0"], machine(num_gpus=1))
    with pytest.raises(DeviceError, match=r"Devices 'cpu' and 'cpu:0' both denote the logical device cpu:0"):
        resolve_devices(["cpu", "cpu:0"], machine())


def test_resolve_empty_and_not_a_list():
    with pytest.raises(DeviceError, match=r"The device list is empty\. Received: devices=\[\]\. Name at least one"):
        resolve_devices([], machine())
    with pytest.raises(
        DeviceError,
        match=r"must be a list of device names\. Received: devices='cpu:0'\. "
        r"Use a list",
    ):
        resolve_devices("cpu:0", machine())


def test_resolve_unknown_name():
    with pytest.raises(DeviceError, match=r"Received: name='/tpu:0'"):
        resolve_devices(["cpu:0", "/tpu:0"], machine())


def test_resolve_remote_device_needs_multi_worker():
    with pytest.raises(
        DeviceError,
        match=r"Device '/job:worker/replica:0/task:1/device:GPU:0' is on task worker:1, "
        r"not on this process \(localhost:0\)\. .*MultiWorkerMirroredStrategy",
    ):
        resolve_devices(["/job:worker/replica:0/task:1/device:GPU:0"], machine(num_gpus=1))
    with pytest.raises(DeviceError, match=r"is on task worker:0, not on this process \(worker:1\)"):
        resolve_devices(["/job:worker/task:0/cpu:0"], machine(), local_task=("worker", 1))


def test_resolve_gpu_without_gpus_carries_the_diagnosis():
    facts = EnvironmentFacts(
        torch_version="2.4.0+cu124",
        torch_cuda_version="12.4",
        driver_present=True,
        driver_version="550.54.15",
        cuda_visible_devices="",
        nvml_device_count=2,
    )
    with pytest.raises(
        DeviceError,
        match=r"^Device 'cuda:0' is a GPU, but no GPU is visible to torch\. "
        r"Received: name='cuda:0'\. CUDA_VISIBLE_DEVICES='' hides every GPU "
        r"from torch\. Unset it .* Or use the CPU: devices=\['cpu:0'\]\.$",
    ):
        resolve_devices(["cuda:0"], machine(), facts=facts)


def test_resolve_gpu_on_cpu_only_build():
    with pytest.raises(DeviceError, match=r"Received: name='/GPU:0'\. torch 2\.13\.0\+cpu is a CPU-only build"):
        resolve_devices(["/GPU:0"], machine(), facts=CPU_ONLY_FACTS)


# ---- default_devices ----------------------------------------------------------------------------


def test_default_devices_every_gpu():
    registry = machine(num_gpus=2)
    registry.set_logical_device_configuration("cuda:1", [LogicalDeviceConfiguration()] * 2)
    devices, decision = default_devices(registry)
    assert names(devices) == ["cuda:0", "cuda:1", "cuda:2"]
    assert decision.subject == "devices"
    assert decision.choice == "cuda:0, cuda:1, cuda:2"
    assert decision.reason == "every visible GPU: 3 logical GPU(s) on 2 physical GPU(s)"


def test_default_devices_cpu_says_why():
    devices, decision = default_devices(machine(), CPU_ONLY_FACTS)
    assert names(devices) == ["cpu:0"]
    assert decision.choice == "cpu:0"
    assert decision.reason == (
        "no usable GPU, so the single device cpu:0. torch 2.13.0+cpu is a CPU-only build "
        "(torch.version.cuda is None): training runs on the CPU. For one replica per logical CPU "
        "pass devices=['cpu:0', 'cpu:1']."
    )
