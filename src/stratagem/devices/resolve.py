"""From the device names a user wrote to the logical devices a strategy places replicas on.

Every mistake in a device list is caught here, before any work starts, with an error that quotes
the names received: unknown names, indices out of range, the same device named twice, an empty
list, a GPU asked for where none is visible (with the diagnosis of why), and a device on another
task of a cluster.
"""

from __future__ import annotations

from collections.abc import Sequence

from stratagem import environ
from stratagem.devices.logical import DeviceRegistry, LogicalDevice, default_registry
from stratagem.devices.names import DeviceName, DeviceSpec, parse_device
from stratagem.diagnose.checks import gpu_unavailable_reason
from stratagem.diagnose.decisions import PlacementDecision
from stratagem.diagnose.facts import EnvironmentFacts, collect_facts
from stratagem.errors import DeviceError

LOCAL_TASK = ("localhost", 0)
"""TensorFlow's name for the one task of a single-process program."""


def resolve_devices(
    names: Sequence[DeviceName],
    registry: DeviceRegistry | None = None,
    *,
    facts: EnvironmentFacts | None = None,
    local_task: tuple[str, int] = LOCAL_TASK,
) -> list[LogicalDevice]:
    """Validates a device list and returns its logical devices, in the order given.

    ``cpu`` means ``cpu:0`` and ``cuda`` means ``cuda:0``. Resolving freezes the registry's
    logical-device configuration. ``facts`` explains a missing GPU (collected when needed);
    ``local_task`` is this process's (job, task), for TensorFlow names qualified with one.

    Example:
        >>> registry = DeviceRegistry.from_facts(EnvironmentFacts(torch_version="2.3.0+cpu", cpu_count=2))
        >>> [d.name for d in resolve_devices(["/cpu:0", "cpu:1"], registry)]
        ['cpu:0', 'cpu:1']

    Raises:
        DeviceError: the list is empty, not a list, or names an unknown, out-of-range, duplicated,
            unavailable or remote device.
    """
    registry = registry or default_registry
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        raise DeviceError(
            f"devices must be a list of device names. Received: devices={names!r}. "
            f"Use a list, e.g. devices=['cuda:0', 'cuda:1'] or devices=['cpu:0']."
        )
    if not names:
        raise DeviceError(
            "The device list is empty. Received: devices=[]. Name at least one device, e.g. "
            "devices=['cpu:0'], or pass no devices to use every GPU (or the CPU when there is none)."
        )
    specs = [parse_device(name) for name in names]
    for name, spec in zip(names, specs):
        _check_local(name, spec, local_task)
    logical = {device.name: device for device in registry.get_logical_devices()}
    resolved: list[LogicalDevice] = []
    first_name: dict[str, DeviceName] = {}
    for name, spec in zip(names, specs):
        canonical = f"{spec.device_type}:{spec.index or 0}"
        if canonical not in logical:
            raise _unavailable(name, spec, logical, facts)
        if canonical in first_name:
            raise DeviceError(
                f"Devices {str(first_name[canonical])!r} and {str(name)!r} both denote the logical device "
                f"{canonical}. Received: devices={[str(n) for n in names]}. List each device once; for "
                f"several replicas on one GPU, split it with set_logical_device_configuration."
            )
        first_name[canonical] = name
        resolved.append(logical[canonical])
    registry.mark_used(f"resolve_devices({[d.name for d in resolved]})")
    return resolved


def default_devices(
    registry: DeviceRegistry | None = None, facts: EnvironmentFacts | None = None
) -> tuple[list[LogicalDevice], PlacementDecision]:
    """What ``MirroredStrategy()`` uses without a device list: every logical GPU, else ``cpu:0``.

    The decision's reason says which and why; on a machine without a usable GPU it carries the
    diagnosis (e.g. "torch 2.13.0+cpu is a CPU-only build").

    Example:
        >>> facts = EnvironmentFacts(torch_version="2.3.0+cpu", cpu_count=2)
        >>> devices, decision = default_devices(DeviceRegistry.from_facts(facts), facts)
        >>> [d.name for d in devices], decision.choice
        (['cpu:0'], 'cpu:0')
    """
    registry = registry or default_registry
    gpus = registry.get_logical_devices("cuda")
    if gpus:
        physical = {gpu.physical for gpu in gpus}
        reason = f"every visible GPU: {len(gpus)} logical GPU(s) on {len(physical)} physical GPU(s)"
        devices = gpus
    else:
        facts = facts or collect_facts(environ.current())
        why = gpu_unavailable_reason(facts)
        num_cpus = len(registry.get_logical_devices("cpu"))
        parts = ["no usable GPU, so the single device cpu:0."]
        if why is not None:
            parts.append(why.reason)
        if num_cpus > 1:
            parts.append(f"For one replica per logical CPU pass devices={[f'cpu:{i}' for i in range(num_cpus)]}.")
        reason = " ".join(parts)
        devices = [registry.get_logical_devices("cpu")[0]]
    registry.mark_used(f"default_devices() -> {[d.name for d in devices]}")
    decision = PlacementDecision(subject="devices", choice=", ".join(d.name for d in devices), reason=reason)
    return devices, decision


def _check_local(name: DeviceName, spec: DeviceSpec, local_task: tuple[str, int]) -> None:
    job, task = local_task
    remote = (
        (spec.job is not None and spec.job != job)
        or (spec.task is not None and spec.task != task)
        or (spec.replica is not None and spec.replica != 0)
    )
    if remote:
        where = f"{spec.job or job}:{spec.task if spec.task is not None else task}"
        raise DeviceError(
            f"Device {str(name)!r} is on task {where}, not on this process ({job}:{task}). Received: "
            f"name={str(name)!r}. A strategy in one process uses only its own devices; remote devices need "
            "MultiWorkerMirroredStrategy, which runs one process per task and combines them."
        )


def _unavailable(
    name: DeviceName, spec: DeviceSpec, logical: dict[str, LogicalDevice], facts: EnvironmentFacts | None
) -> DeviceError:
    kind = "CPU" if spec.device_type == "cpu" else "GPU"
    have = [d for d in logical.values() if d.device_type == spec.device_type]
    if spec.device_type == "cuda" and not have:
        facts = facts or collect_facts(environ.current())
        why = gpu_unavailable_reason(facts)
        diagnosis = why.message if why else "torch sees no GPU; run `stratagem doctor` for details."
        return DeviceError(
            f"Device {str(name)!r} is a GPU, but no GPU is visible to torch. Received: name={str(name)!r}. "
            f"{diagnosis} Or use the CPU: devices=['cpu:0']."
        )
    index = spec.index or 0
    span = f"{spec.device_type}:0..{spec.device_type}:{len(have) - 1}"
    if spec.device_type == "cpu":
        fix = f"Use one of {span}, or call sg.devices.set_logical_device_configuration('cpu', {index + 1})"
    else:
        fix = (
            f"Use one of {span}, check CUDA_VISIBLE_DEVICES (it renumbers visible GPUs from 0), or "
            f"split GPUs with sg.devices.set_logical_device_configuration('cuda', [...])"
        )
    return DeviceError(
        f"Device {str(name)!r} is out of range: this machine has {len(have)} logical {kind} devices ({span}). {fix}."
    )
