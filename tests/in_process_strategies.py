"""The in-process strategies that a feature's equivalence tests run under, by name: one device, and 2 or 3
logical CPU devices mirrored (parameters shared or copied per replica) or in central storage."""

from __future__ import annotations

from conftest import cpu_registry

import stratagem as sg

STRATEGIES = {
    "one-device": lambda: sg.OneDeviceStrategy("cpu"),
    "mirrored-2": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(3)),
    "mirrored-3": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3)),
    "mirrored-3-copies": lambda: sg.MirroredStrategy(
        ["cpu:0", "cpu:1", "cpu:2"], share_parameters=False, registry=cpu_registry(3)
    ),
    "central-3": lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3)),
}
