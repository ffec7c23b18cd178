"""Device names in TensorFlow's and PyTorch's spellings, parsed into one `DeviceSpec`.

TensorFlow users write ``/gpu:0``, ``/device:GPU:0`` or a fully qualified
``/job:worker/replica:0/task:1/device:GPU:0``; PyTorch users write ``cuda:0``, ``cpu`` or pass a
``torch.device``. Both spellings name the same thing here, so a script ported from
``tf.distribute`` keeps its device lists.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal, Union, cast

import torch

from stratagem.errors import DeviceError

DeviceType = Literal["cpu", "cuda"]
DeviceName = Union[str, torch.device]

ACCEPTED_SPELLINGS = (
    "'cpu', 'cpu:N', 'cuda', 'cuda:N' (torch), '/cpu:N', '/gpu:N', '/device:CPU:N', "
    "'/device:GPU:N', '/job:NAME/replica:R/task:T/device:GPU:N' (TensorFlow) or a torch.device"
)

# TensorFlow says GPU where torch says cuda; both spellings map to torch's.
_TYPE_ALIASES = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}

_TORCH_NAME = re.compile(r"^(?P<type>[A-Za-z]+)(?::(?P<index>\d+))?$")
_TF_FIELD = re.compile(r"^(?P<key>job|replica|task|device):(?P<value>.+)$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """A parsed device name.

    Example:
        >>> spec = parse_device("/job:worker/replica:0/task:1/device:GPU:0")
        >>> spec.torch_name, spec.task
        ('cuda:0', 1)
        >>> parse_device("cpu:3").tf_name
        '/device:CPU:3'
    """

    job: str | None = None
    """The TensorFlow job (``worker``, ``chief``, ...), when the name was qualified with one."""
    replica: int | None = None
    """The TensorFlow replica field; kept for round-tripping, stratagem places by task."""
    task: int | None = None
    """The task index within ``job``, when qualified."""
    device_type: DeviceType
    """``"cpu"`` or ``"cuda"`` (TensorFlow's ``GPU``)."""
    index: int | None = None
    """The logical device index; ``None`` when the name had none (``"cuda"``, ``"/gpu"``)."""

    @property
    def torch_name(self) -> str:
        """The torch spelling: ``"cpu:3"``, ``"cuda:1"``, or ``"cuda"`` without an index."""
        return self.device_type if self.index is None else f"{self.device_type}:{self.index}"

    @property
    def tf_name(self) -> str:
        """The TensorFlow spelling: ``"/device:CPU:3"``, with job, replica and task when set."""
        parts = []
        if self.job is not None:
            parts.append(f"/job:{self.job}")
        if self.replica is not None:
            parts.append(f"/replica:{self.replica}")
        if self.task is not None:
            parts.append(f"/task:{self.task}")
        tf_type = "GPU" if self.device_type == "cuda" else "CPU"
        index = "*" if self.index is None else str(self.index)
        parts.append(f"/device:{tf_type}:{index}")
        return "".join(parts)

    @property
    def is_qualified(self) -> bool:
        """Whether the name carried a job, replica or task (a TensorFlow cluster name)."""
        return self.job is not None or self.replica is not None or self.task is not None


def parse_device(name: DeviceName) -> DeviceSpec:
    """Parses a device name in either spelling.

    Example:
        >>> parse_device("/GPU:1") == parse_device("cuda:1") == parse_device(torch.device("cuda", 1))
        True

    Raises:
        DeviceError: the name is not a CPU or CUDA device in an accepted spelling.
    """
    if isinstance(name, torch.device):
        return _from_torch_device(name)
    if not isinstance(name, str):
        raise DeviceError(
            f"A device name must be a string or a torch.device. "
            f"Received: name={name!r} of type {type(name).__name__}. Use {ACCEPTED_SPELLINGS}."
        )
    text = name.strip()
    if text.startswith("/"):
        return _parse_tf(name, text)
    # "GPU:0" without the leading slash is also accepted by TensorFlow.
    match = _TORCH_NAME.match(text)
    if match is None:
        raise _unknown(name)
    return DeviceSpec(device_type=_device_type(name, match["type"]), index=_index(match["index"]))


def _from_torch_device(device: torch.device) -> DeviceSpec:
    if device.type not in ("cpu", "cuda"):
        raise _unknown(device)
    return DeviceSpec(device_type=cast(DeviceType, device.type), index=device.index)  # one of the two: checked above


def _parse_tf(name: str, text: str) -> DeviceSpec:
    fields: dict[str, str] = {}
    device_type: DeviceType | None = None
    index: int | None = None
    for part in text.strip("/").split("/"):
        field = _TF_FIELD.match(part)
        if field is not None and field["key"] != "device":
            if field["key"] in fields:
                raise _unknown(name)
            fields[field["key"]] = field["value"]
            continue
        # "/device:GPU:0" and the short "/gpu:0" both name the device itself.
        device_part = field["value"] if field is not None else part
        if device_type is not None:
            raise _unknown(name)
        typed = _TORCH_NAME.match(device_part) or re.match(r"^(?P<type>[A-Za-z]+):\*$", device_part)
        if typed is None:
            raise _unknown(name)
        device_type = _device_type(name, typed["type"])
        index = _index(typed.groupdict().get("index"))
    if device_type is None:
        raise DeviceError(
            f"Device name {name!r} has no device part. Received: name={name!r}. "
            f"Add one, e.g. {text.rstrip('/')}/device:GPU:0."
        )
    for key in ("replica", "task"):
        if key in fields and not fields[key].isdigit():
            raise _unknown(name)
    return DeviceSpec(
        job=fields.get("job"),
        replica=int(fields["replica"]) if "replica" in fields else None,
        task=int(fields["task"]) if "task" in fields else None,
        device_type=device_type,
        index=index,
    )


def _device_type(name: DeviceName, raw_type: str) -> DeviceType:
    device_type = _TYPE_ALIASES.get(raw_type.lower())
    if device_type is None:
        raise DeviceError(
            f"Device type {raw_type!r} is not supported: stratagem places work on CPUs and CUDA GPUs. "
            f"Received: name={str(name)!r}. Use {ACCEPTED_SPELLINGS}."
        )
    return device_type  # type: ignore[return-value]


def _index(raw: str | None) -> int | None:
    return None if raw is None else int(raw)


def _unknown(name: DeviceName) -> DeviceError:
    return DeviceError(f"Device name is not recognised. Received: name={str(name)!r}. Use {ACCEPTED_SPELLINGS}.")
