"""``stratagem devices``: the physical and logical devices of this machine.

Usage:
    $ stratagem devices
    $ stratagem devices --json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from stratagem import environ
from stratagem.devices import DeviceRegistry
from stratagem.diagnose import collect_facts, format_bytes, gpu_unavailable_reason


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "devices",
        help="list physical and logical devices",
        description="List the physical devices (CPU, CUDA GPUs) and the logical devices strategies place replicas on.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return parser


def run(args: argparse.Namespace) -> int:
    facts = collect_facts(environ.current())
    registry = DeviceRegistry.from_facts(facts)
    physical = registry.physical_devices()
    logical = registry.get_logical_devices()
    no_gpu = gpu_unavailable_reason(facts)
    if args.json:
        report: dict[str, Any] = {
            "physical": [device.to_dict() for device in physical],
            "logical": [device.to_dict() for device in logical],
            "no_gpu_reason": no_gpu.to_dict() if no_gpu else None,
        }
        print(json.dumps(report, indent=2))
        return 0
    console = Console()
    table = Table(title="Physical devices")
    for column in ("device", "name", "cores", "memory (free / total)", "capability"):
        table.add_column(column)
    for device in physical:
        memory = (
            ""
            if device.total_memory is None
            else f"{format_bytes(device.free_memory) if device.free_memory is not None else '?'} / "
            f"{format_bytes(device.total_memory)}"
        )
        capability = "" if device.capability is None else ".".join(map(str, device.capability))
        table.add_row(device.torch_name, device.name, str(device.core_count or ""), memory, capability)
    console.print(table)
    table = Table(title="Logical devices")
    for column in ("device", "runs on", "memory limit"):
        table.add_column(column)
    for logical_device in logical:
        limit = "" if logical_device.memory_limit is None else format_bytes(logical_device.memory_limit)
        table.add_row(logical_device.name, str(logical_device.physical), limit)
    console.print(table)
    if no_gpu is not None:
        console.print(f"No GPU: {no_gpu.message}", markup=False, highlight=False)
    return 0
