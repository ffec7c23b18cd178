"""Facts about the machine's GPU stack, gathered once into plain data.

Everything that decides *why* a GPU is or is not usable reads an `EnvironmentFacts` value, never
the machine itself, so each diagnosis can be tested on a CPU-only machine with constructed facts
and a report from a user's machine can be replayed (`EnvironmentFacts.from_dict`).

Every probe is optional and guarded: a missing driver library, a hung ``nvidia-smi`` or an absent
``pynvml`` leaves its field ``None`` and never raises.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)

# nvidia-smi can hang for tens of seconds on a wedged driver; a diagnosis must not.
NVIDIA_SMI_TIMEOUT_S = 5.0


@dataclasses.dataclass(kw_only=True)
class GpuFacts:
    """One CUDA device as torch sees it."""

    index: int
    """torch's index (after ``CUDA_VISIBLE_DEVICES`` renumbering)."""
    name: str
    total_memory: int
    """Bytes."""
    free_memory: int | None = None
    """Bytes free when the facts were collected (``torch.cuda.mem_get_info``)."""
    capability: tuple[int, int] | None = None
    """Compute capability, e.g. ``(9, 0)`` for an H100."""


@dataclasses.dataclass(kw_only=True)
class EnvironmentFacts:
    """What the machine offers for GPU training, as plain JSON-serialisable data.

    Example:
        >>> facts = EnvironmentFacts(torch_version="2.3.0+cpu", torch_cuda_version=None)
        >>> facts.is_cuda_build
        False
    """

    torch_version: str
    torch_cuda_version: str | None = None
    """``torch.version.cuda``: the CUDA version torch was built for; ``None`` for a CPU-only build."""
    cuda_runtime_version: str | None = None
    """The CUDA runtime actually loaded (``cudaRuntimeGetVersion``), when it could be read."""
    driver_present: bool = False
    """Whether any sign of the NVIDIA driver was found (libcuda, /proc, NVML or nvidia-smi)."""
    driver_version: str | None = None
    """The driver release, e.g. ``"550.54.15"``."""
    driver_cuda_version: str | None = None
    """The newest CUDA version the driver supports (``cuDriverGetVersion``), e.g. ``"12.4"``."""
    cuda_visible_devices: str | None = None
    """The raw ``CUDA_VISIBLE_DEVICES`` value; ``None`` when unset (which is not the same as ``""``)."""
    torch_device_count: int = 0
    """The GPUs torch can use: 0 unless ``torch.cuda.is_available()``, then ``torch.cuda.device_count()``.
    (Before CUDA starts, ``device_count()`` alone may answer NVML's count, even when CUDA cannot start.)"""
    nvml_device_count: int | None = None
    """GPUs the driver reports through NVML (pynvml or nvidia-smi), ignoring ``CUDA_VISIBLE_DEVICES``."""
    nvml_uuids: list[str] | None = None
    """The driver's GPU and MIG UUIDs (``nvidia-smi -L``), ignoring ``CUDA_VISIBLE_DEVICES``; None if unknown."""
    cuda_init_error: str | None = None
    """The text of a failed CUDA start (what ``torch.cuda.is_available()`` warned, or the first CUDA call
    raised); None when CUDA started or was never tried."""
    nccl_available: bool = False
    nccl_version: str | None = None
    cudnn_available: bool = False
    cudnn_version: int | None = None
    cpu_count: int = 1
    """CPU cores this process may run on."""
    gpus: list[GpuFacts] = dataclasses.field(default_factory=list)
    memory_limit: dict[str, Any] | None = None
    """The tightest host memory limit on this process (`stratagem.diagnose.memory_limit`: ``limit``, ``used``,
    ``headroom`` in bytes, ``None`` for no limit, and its ``source``); None when not read (older facts files)."""

    @property
    def is_cuda_build(self) -> bool:
        return self.torch_cuda_version is not None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EnvironmentFacts:
        """Rebuilds facts written by `to_dict` (e.g. ``stratagem doctor --json`` from another machine)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {key: value for key, value in data.items() if key in fields}
        gpus = []
        for gpu in values.pop("gpus", []):
            gpu = dict(gpu)
            if gpu.get("capability") is not None:
                gpu["capability"] = tuple(gpu["capability"])
            gpus.append(GpuFacts(**gpu))
        return cls(gpus=gpus, **values)


def collect_facts(env: Mapping[str, str]) -> EnvironmentFacts:
    """Gathers the facts on this machine.

    Cheap where it can be: with a CPU-only torch build no CUDA call is made at all; with a CUDA
    build, free memory is read per GPU (``torch.cuda.mem_get_info``), which creates a CUDA
    context on each.

    Example:
        >>> from stratagem import environ
        >>> facts = collect_facts(environ.current())
        >>> facts.torch_version == torch.__version__
        True
    """
    facts = EnvironmentFacts(
        torch_version=torch.__version__,
        torch_cuda_version=torch.version.cuda,
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        cpu_count=cpu_count(),
    )
    _probe_driver(facts)
    facts.memory_limit = _read_memory_limit()
    if facts.is_cuda_build:
        facts.torch_device_count, facts.cuda_init_error = cuda_start()
        facts.nccl_available, facts.nccl_version = _nccl()
        facts.cudnn_available, facts.cudnn_version = _cudnn()
        facts.cuda_runtime_version = _cuda_runtime_version(facts.torch_cuda_version)
        facts.gpus, error = _probe_gpus_reporting(facts.torch_device_count, free_memory=True)
        if error is not None:
            facts.cuda_init_error = facts.cuda_init_error or error
            facts.torch_device_count = len(facts.gpus)
    return facts


def _read_memory_limit() -> dict[str, Any] | None:
    """This process's host memory limit as data, or None where it could not be read (not Linux, a probe error)."""
    from stratagem.diagnose.memory_limit import read_memory_limit

    try:
        return read_memory_limit().to_dict()
    except (OSError, ValueError) as error:  # a cgroup file with something unexpected in it
        logger.warning("could not read the memory limit: %s", error)
        return None


def cuda_start() -> tuple[int, str | None]:
    """The GPUs torch can use and, when CUDA failed to start, the text of the failure.

    Counts with ``torch.cuda.is_available()``, which starts CUDA's device enumeration and turns a
    failure into False plus a warning; that warning's text is what `stratagem.diagnose.check_cuda_start`
    turns into a verdict. Never raises.
    """
    if torch.version.cuda is None:
        return 0, None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            available = torch.cuda.is_available()
        if available:
            return int(torch.cuda.device_count()), None
    except Exception as error:  # noqa: BLE001 - a probe reports, it never raises
        return 0, _cuda_error_text(str(error))
    for warning in caught:
        text = str(warning.message)
        if "CUDA initialization" in text or "cudaGetDeviceCount" in text or "driver" in text.lower():
            return 0, _cuda_error_text(text)
    return 0, None  # no device, or all hidden: CUDA reports that without an error


def _cuda_error_text(text: str) -> str:
    """torch's wording around CUDA's error, trimmed: no "CUDA initialization:" prefix, no C++ source location."""
    text = re.sub(r"^\s*CUDA initialization:\s*", "", text.strip())
    text = re.sub(r"\s*\(Triggered internally at [^)]*\)\.?\s*$", "", text)
    return text.strip()


def cpu_count() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def probe_gpus(count: int | None = None, *, free_memory: bool = True) -> list[GpuFacts]:
    """Name, memory and capability of each GPU torch can see; empty for a CPU-only build.

    ``free_memory=False`` leaves ``free_memory`` unread: reading it creates a CUDA context
    (hundreds of MiB) on every GPU, which a process that will use one GPU must not do.
    """
    gpus, error = _probe_gpus_reporting(count, free_memory=free_memory)
    if error is not None:
        logger.warning("could not read the properties of every GPU: %s", error)
    return gpus


def _probe_gpus_reporting(count: int | None, *, free_memory: bool) -> tuple[list[GpuFacts], str | None]:
    """The GPUs whose properties could be read, and the error that stopped the reading (never raised):
    ``get_device_properties`` starts CUDA, which fails at that point on a broken driver stack."""
    if torch.version.cuda is None:
        return [], None
    if count is None:
        count, error = cuda_start()
        if error is not None:
            return [], error
    gpus: list[GpuFacts] = []
    for index in range(count):
        try:
            props = torch.cuda.get_device_properties(index)
        except Exception as error:  # noqa: BLE001 - a probe reports, it never raises
            return gpus, _cuda_error_text(str(error))
        free = None
        try:
            if free_memory:
                free, _ = torch.cuda.mem_get_info(index)
        except RuntimeError as error:  # e.g. a GPU in exclusive-process mode held by another process
            logger.warning("could not read free memory of cuda:%d: %s", index, error)
        gpus.append(
            GpuFacts(
                index=index,
                name=props.name,
                total_memory=int(props.total_memory),
                free_memory=free,
                capability=(props.major, props.minor),
            )
        )
    return gpus, None


def _probe_driver(facts: EnvironmentFacts) -> None:
    # Each source can be missing on its own (containers often lack nvidia-smi, pynvml is
    # optional), so try them all and keep the first answer for each field.
    facts.driver_cuda_version = _libcuda_version()
    facts.driver_version = _proc_driver_version()
    nvml_version, nvml_count = _pynvml()
    if nvml_version is None or nvml_count is None:
        smi_version, smi_count = _nvidia_smi()
        nvml_version = nvml_version or smi_version
        nvml_count = nvml_count if nvml_count is not None else smi_count
    facts.driver_version = facts.driver_version or nvml_version
    facts.nvml_device_count = nvml_count
    facts.nvml_uuids = _nvidia_smi_uuids()
    facts.driver_present = facts.driver_cuda_version is not None or facts.driver_version is not None


def _libcuda_version() -> str | None:
    names = {"win32": ["nvcuda.dll"], "darwin": []}.get(sys.platform, ["libcuda.so.1", "libcuda.so"])
    # cuDriverGetVersion needs no cuInit and no context: it only reports the driver's CUDA level.
    return _cuda_version_from(names, lambda libcuda, version: libcuda.cuDriverGetVersion(version))


def _cuda_version_from(names: Iterable[str], ask: Callable[[ctypes.CDLL, Any], int]) -> str | None:
    """The CUDA version ("12.4") that `ask(library, pointer to an int)` writes, from the first library of
    `names` that loads and answers 0 (CUDA's success); None if none does."""
    for name in names:
        try:
            library = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int()
        if ask(library, ctypes.byref(version)) == 0:
            return f"{version.value // 1000}.{version.value % 1000 // 10}"
    return None


def _proc_driver_version() -> str | None:
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as file:
            text = file.read()
    except OSError:
        return None
    return parse_proc_driver_version(text)


def parse_proc_driver_version(text: str) -> str | None:
    """The driver release in ``/proc/driver/nvidia/version`` (proprietary or open kernel module)."""
    match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return match[1] if match else None


def _pynvml() -> tuple[str | None, int | None]:
    try:
        import pynvml
    except ImportError:
        return None, None
    try:
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception as error:  # pynvml raises NVMLError subclasses for every driver state
        logger.info("NVML not usable: %s", error)
        return None, None
    return (version.decode() if isinstance(version, bytes) else version), int(count)


def _nvidia_smi() -> tuple[str | None, int | None]:
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return None, None
    try:
        result = subprocess.run(
            [executable, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.info("nvidia-smi did not answer: %s", error)
        return None, None
    if result.returncode != 0:
        logger.info("nvidia-smi failed (%d): %s", result.returncode, result.stderr.strip())
        return None, None
    lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
    return (lines[0] if lines else None), len(lines)


def _nvidia_smi_uuids() -> list[str] | None:
    """Every GPU and MIG UUID ``nvidia-smi -L`` lists, in its order; None when it cannot be asked."""
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return None
    try:
        result = subprocess.run(
            [executable, "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.info("nvidia-smi -L did not answer: %s", error)
        return None
    if result.returncode != 0:
        return None
    return parse_nvidia_smi_uuids(result.stdout)


def parse_nvidia_smi_uuids(text: str) -> list[str]:
    """The ``GPU-...`` and ``MIG-...`` UUIDs in ``nvidia-smi -L`` output."""
    return re.findall(r"\(UUID:\s*((?:GPU|MIG)-[0-9A-Za-z-]+)\)", text)


def _nccl() -> tuple[bool, str | None]:
    # The same test torch.cuda.nccl.is_available makes, without its warning.
    if not hasattr(torch._C, "_nccl_all_reduce"):
        return False, None
    try:
        return True, ".".join(str(part) for part in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - a probe reports, it never raises
        return True, None


def _cudnn() -> tuple[bool, int | None]:
    try:
        available = bool(torch.backends.cudnn.is_available())
        return available, (torch.backends.cudnn.version() if available else None)
    except Exception:  # noqa: BLE001 - a probe reports, it never raises
        return False, None


def _cuda_runtime_version(torch_cuda_version: str | None) -> str | None:
    # torch loads its own libcudart; asking it by soname finds the copy already in the process.
    if torch_cuda_version is None or sys.platform == "win32":
        return None
    major = torch_cuda_version.split(".")[0]
    names = (f"libcudart.so.{major}", "libcudart.so")
    return _cuda_version_from(names, lambda cudart, version: cudart.cudaRuntimeGetVersion(version))
