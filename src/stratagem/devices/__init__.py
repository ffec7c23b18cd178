"""Device names in both spellings, physical device discovery, and logical devices.

Example:
    >>> import stratagem as sg
    >>> sg.devices.parse_device("/device:GPU:1").torch_name
    'cuda:1'
    >>> registry = sg.devices.DeviceRegistry()           # tests use their own; programs the default
    >>> [d.name for d in sg.devices.resolve_devices(["/cpu:0"], registry)]
    ['cpu:0']
"""

from stratagem.devices.logical import (
    DeviceRegistry,
    LogicalDevice,
    LogicalDeviceConfiguration,
    default_registry,
    enforce_memory_limits,
    get_logical_devices,
    resident_bytes,
    set_logical_device_configuration,
)
from stratagem.devices.names import ACCEPTED_SPELLINGS, DeviceName, DeviceSpec, DeviceType, parse_device
from stratagem.devices.physical import PhysicalDevice, physical_devices
from stratagem.devices.resolve import LOCAL_TASK, default_devices, resolve_devices

__all__ = [
    "ACCEPTED_SPELLINGS",
    "DeviceName",
    "DeviceRegistry",
    "DeviceSpec",
    "DeviceType",
    "LOCAL_TASK",
    "LogicalDevice",
    "LogicalDeviceConfiguration",
    "PhysicalDevice",
    "default_devices",
    "default_registry",
    "enforce_memory_limits",
    "get_logical_devices",
    "parse_device",
    "physical_devices",
    "resident_bytes",
    "resolve_devices",
    "set_logical_device_configuration",
]
