"""Why is my GPU not used? Pure functions from `EnvironmentFacts` to `Check` verdicts.

Verdicts follow one rule, so ``stratagem doctor`` can turn them into an exit code:

* ``problem``: a GPU the machine has cannot be used (the driver or NVML reports it, torch does
  not get it), or what was asked for cannot run (a device index out of range, a model that does
  not fit). Something is broken and training would not do what the user meant.
* ``warning``: training runs, but not the way a GPU user may expect (a CPU-only build on a machine
  with no GPU, GPUs hidden on purpose, no NCCL, no cuDNN).
* ``ok``: fine, or not applicable (the reason says which).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stratagem.diagnose.cuda_start import check_cuda_start
from stratagem.diagnose.cuda_versions import MIN_DRIVER_FOR_CUDA_MAJOR, major_version, version_numbers
from stratagem.diagnose.facts import EnvironmentFacts
from stratagem.diagnose.verdict import Check, Verdict
from stratagem.diagnose.visible_devices import read_visible_devices

INSTALL_CUDA_TORCH = "install a CUDA build of torch (pick one at https://pytorch.org/get-started/locally/)"


def check_torch_build(facts: EnvironmentFacts) -> Check:
    """A CPU-only torch build cannot use any GPU; a problem only when the machine has one."""
    if facts.is_cuda_build:
        return Check(
            name="torch_build",
            verdict="ok",
            reason=f"torch {facts.torch_version} is built for CUDA {facts.torch_cuda_version}.",
        )
    reason = f"torch {facts.torch_version} is a CPU-only build (torch.version.cuda is None)"
    if facts.nvml_device_count:
        newest = f" for CUDA {facts.driver_cuda_version} or older" if facts.driver_cuda_version else ""
        return Check(
            name="torch_build",
            verdict="problem",
            reason=f"{reason}, but the driver reports {facts.nvml_device_count} GPU(s): they sit idle.",
            fix=f"Install a CUDA build of torch{newest} (pick one at https://pytorch.org/get-started/locally/).",
        )
    return Check(
        name="torch_build",
        verdict="warning",
        reason=f"{reason}: training runs on the CPU.",
        fix=f"To train on an NVIDIA GPU, {INSTALL_CUDA_TORCH}.",
    )


def check_driver(facts: EnvironmentFacts) -> Check:
    """A CUDA build of torch needs the NVIDIA driver (libcuda) to see any GPU."""
    if not facts.is_cuda_build:
        return Check(name="driver", verdict="ok", reason="Not applicable: torch is a CPU-only build.")
    if facts.driver_present:
        found = ", ".join(
            part
            for part in (
                f"release {facts.driver_version}" if facts.driver_version else "",
                f"supports CUDA up to {facts.driver_cuda_version}" if facts.driver_cuda_version else "",
            )
            if part
        )
        return Check(name="driver", verdict="ok", reason=f"NVIDIA driver found ({found}).")
    minimum = MIN_DRIVER_FOR_CUDA_MAJOR.get(major_version(facts.torch_cuda_version))
    needed = f" (release {minimum} or newer for CUDA {facts.torch_cuda_version})" if minimum else ""
    return Check(
        name="driver",
        verdict="warning",
        reason=(
            f"torch {facts.torch_version} is built for CUDA {facts.torch_cuda_version}, but no NVIDIA "
            "driver was found (no libcuda, no /proc/driver/nvidia, no NVML, no nvidia-smi): "
            "no GPU can be used."
        ),
        fix=(
            f"If this machine has an NVIDIA GPU, install the NVIDIA driver{needed}; in a container, "
            "start it with GPU access (docker run --gpus all)."
        ),
    )


def check_driver_version(facts: EnvironmentFacts) -> Check:
    """The driver must be new enough for the CUDA version torch was built for."""
    if not facts.is_cuda_build or not facts.driver_present:
        return Check(name="driver_version", verdict="ok", reason="Not applicable: no CUDA build or no driver.")
    torch_cuda = facts.torch_cuda_version
    major = major_version(torch_cuda)
    minimum = MIN_DRIVER_FOR_CUDA_MAJOR.get(major)
    if facts.driver_version and minimum and version_numbers(facts.driver_version) < version_numbers(minimum):
        supports = f" (it supports CUDA up to {facts.driver_cuda_version})" if facts.driver_cuda_version else ""
        return Check(
            name="driver_version",
            verdict="problem",
            reason=(
                f"NVIDIA driver {facts.driver_version} is too old for torch {facts.torch_version}, built "
                f"for CUDA {torch_cuda}: CUDA {major}.x needs driver {minimum} or newer."
            ),
            fix=(
                f"Update the NVIDIA driver to {minimum} or newer, or install a torch build for a CUDA "
                f"version that driver {facts.driver_version} supports{supports}."
            ),
        )
    if facts.driver_cuda_version and version_numbers(facts.driver_cuda_version) < version_numbers(torch_cuda):
        if major_version(facts.driver_cuda_version) < major:
            return Check(
                name="driver_version",
                verdict="problem",
                reason=(
                    f"The NVIDIA driver supports CUDA up to {facts.driver_cuda_version}, older than "
                    f"CUDA {torch_cuda} that torch {facts.torch_version} is built for."
                ),
                fix=(
                    f"Update the NVIDIA driver{f' to {minimum} or newer' if minimum else ''}, or install a "
                    f"torch build for CUDA {facts.driver_cuda_version} or older."
                ),
            )
        return Check(
            name="driver_version",
            verdict="warning",
            reason=(
                f"The NVIDIA driver supports CUDA up to {facts.driver_cuda_version} and torch is built "
                f"for CUDA {torch_cuda}: it runs under minor-version compatibility, where kernels "
                "compiled just in time from PTX are not available."
            ),
            fix=f"Update the NVIDIA driver to one that supports CUDA {torch_cuda} if a kernel fails to load.",
        )
    return Check(name="driver_version", verdict="ok", reason=f"The NVIDIA driver is new enough for CUDA {torch_cuda}.")


def check_cuda_visible_devices(facts: EnvironmentFacts) -> Check:
    """``CUDA_VISIBLE_DEVICES`` can hide GPUs: on purpose (``""``, ``-1``) or by an entry CUDA rejects.

    The value is read as CUDA reads it (`stratagem.diagnose.visible_devices`): it stops at the first
    invalid entry (an index out of range, ``GPU-bogus``, a UUID the driver does not list), a GPU named
    twice (``0,0``) hides them all, and only the first of several MIG devices is enumerated.
    """
    raw = facts.cuda_visible_devices
    if raw is None:
        return Check(
            name="cuda_visible_devices", verdict="ok", reason="CUDA_VISIBLE_DEVICES is not set: every GPU is visible."
        )
    unset = "Unset it (unset CUDA_VISIBLE_DEVICES) or list the GPUs to use, e.g. CUDA_VISIBLE_DEVICES=0,1."
    seen = read_visible_devices(raw, driver_count=facts.nvml_device_count, uuids=facts.nvml_uuids)
    # Hiding GPUs by mistake matters only where GPUs exist; without any it changes nothing.
    gpus_exist = bool(facts.nvml_device_count) or (facts.nvml_device_count is None and facts.driver_present)
    mistake: Verdict = "problem" if gpus_exist else "warning"
    if seen.on_purpose:
        return Check(
            name="cuda_visible_devices",
            verdict="warning",
            reason=f"CUDA_VISIBLE_DEVICES={raw!r} hides every GPU from torch.",
            fix=unset,
        )
    if seen.hides_all is not None:
        return Check(
            name="cuda_visible_devices",
            verdict=mistake,
            reason=f"CUDA_VISIBLE_DEVICES={raw!r} names a GPU twice: {seen.hides_all}, so torch sees no GPU.",
            fix="List each GPU once, e.g. CUDA_VISIBLE_DEVICES=0,1, or unset it.",
        )
    if seen.invalid is not None:
        sees = f"only {', '.join(seen.visible)}" if seen.visible else "no GPU"
        range_hint = f"indices 0..{facts.nvml_device_count - 1}" if facts.nvml_device_count else "GPU indices"
        return Check(
            name="cuda_visible_devices",
            verdict=mistake,
            reason=(
                f"CUDA_VISIBLE_DEVICES={raw!r} has an invalid entry {seen.invalid!r} ({seen.why_invalid}). CUDA "
                f"ignores an invalid entry and every entry after it, so torch sees {sees}."
            ),
            fix=(
                f"Set CUDA_VISIBLE_DEVICES to comma-separated {range_hint} or GPU UUIDs (nvidia-smi -L lists "
                "them), or unset it."
            ),
        )
    migs = [entry for entry in seen.visible if entry.startswith("MIG-")]
    if seen.mig_ignored:
        return Check(
            name="cuda_visible_devices",
            verdict="warning",
            reason=(
                f"CUDA_VISIBLE_DEVICES={raw!r} names {len(migs) + len(seen.mig_ignored)} MIG devices, but CUDA "
                f"enumerates one MIG device per process, so torch sees {', '.join(seen.visible)} and not "
                f"{', '.join(seen.mig_ignored)}."
            ),
            fix=(
                "Run one process per MIG device, each with its own CUDA_VISIBLE_DEVICES=MIG-... (e.g. one "
                "MultiWorkerMirroredStrategy worker per MIG device)."
            ),
        )
    of = f" of the {facts.nvml_device_count} the driver reports" if facts.nvml_device_count else ""
    mig = f", MIG device {migs[0]}" if migs else ""
    return Check(
        name="cuda_visible_devices",
        verdict="ok",
        reason=f"CUDA_VISIBLE_DEVICES={raw!r} selects {seen.count} GPU(s){of}{mig}.",
    )


def visible_by_cuda_visible_devices(facts: EnvironmentFacts) -> int | None:
    """How many GPUs ``CUDA_VISIBLE_DEVICES`` leaves visible; ``None`` when it does not restrict them."""
    raw = facts.cuda_visible_devices
    if raw is None:
        return None
    return read_visible_devices(raw, driver_count=facts.nvml_device_count, uuids=facts.nvml_uuids).count


def check_gpu_visibility(facts: EnvironmentFacts) -> Check:
    """The driver (NVML) sees GPUs that torch does not, beyond what ``CUDA_VISIBLE_DEVICES`` selects."""
    driver_count = facts.nvml_device_count
    if driver_count is None:
        return Check(
            name="nvml_vs_torch",
            verdict="ok",
            reason="Not checked: neither NVML (pynvml) nor nvidia-smi could be queried.",
        )
    selected = visible_by_cuda_visible_devices(facts)
    expected = driver_count if selected is None else min(selected, driver_count)
    seen = facts.torch_device_count
    selection = "" if selected is None else f", as CUDA_VISIBLE_DEVICES={facts.cuda_visible_devices!r} selects"
    if seen >= expected:
        return Check(
            name="nvml_vs_torch",
            verdict="ok",
            reason=f"torch sees {seen} of the {driver_count} GPU(s) the driver reports{selection}.",
        )
    if not facts.is_cuda_build:
        fix = f"torch is a CPU-only build: {INSTALL_CUDA_TORCH}."
    else:
        fix = (
            "Check the driver checks above, that this process may open /dev/nvidia* (containers: "
            'docker run --gpus all), and run python -c "import torch; torch.cuda.init()" to see '
            "CUDA's own error."
        )
    return Check(
        name="nvml_vs_torch",
        verdict="problem",
        reason=(
            f"The driver (NVML) reports {driver_count} GPU(s) and {expected} should be visible, but torch sees {seen}."
        ),
        fix=fix,
    )


def check_device_index(facts: EnvironmentFacts, requested: Sequence[int]) -> Check:
    """Requested GPU indices must be below torch's device count."""
    count = facts.torch_device_count
    out_of_range = [index for index in requested if not 0 <= index < count]
    if not out_of_range:
        return Check(
            name="device_index", verdict="ok", reason=f"Requested GPU(s) {list(requested)} exist (torch sees {count})."
        )
    names = ", ".join(f"cuda:{index}" for index in out_of_range)
    renumber = (
        f" CUDA_VISIBLE_DEVICES={facts.cuda_visible_devices!r} renumbers the visible GPUs from 0."
        if facts.cuda_visible_devices is not None
        else ""
    )
    available = f"cuda:0..cuda:{count - 1}" if count else "none"
    fix = f"Use indices 0..{count - 1}." if count else (gpu_unavailable_reason(facts) or _no_gpu_fallback(facts)).fix
    return Check(
        name="device_index",
        verdict="problem",
        reason=f"Requested {names} is out of range: torch sees {count} GPU(s) ({available}).{renumber}",
        fix=fix,
    )


def check_nccl(facts: EnvironmentFacts) -> Check:
    """Without NCCL, all-reduce across GPUs of one process reduces through one device."""
    if facts.torch_device_count < 2:
        return Check(name="nccl", verdict="ok", reason="Not needed: fewer than 2 GPUs are visible.")
    if facts.nccl_available:
        version = f" {facts.nccl_version}" if facts.nccl_version else ""
        return Check(name="nccl", verdict="ok", reason=f"NCCL{version} is available for all-reduce across GPUs.")
    return Check(
        name="nccl",
        verdict="warning",
        reason=(
            f"torch {facts.torch_version} has no NCCL, so all-reduce across the {facts.torch_device_count} "
            "GPUs falls back to reduction to one device (copy to cuda:0, sum there, copy back), "
            "which is slower."
        ),
        fix="Install a torch build with NCCL (the official Linux CUDA wheels include it).",
    )


def check_cudnn(facts: EnvironmentFacts) -> Check:
    """Without cuDNN, convolutions and RNNs on the GPU run slower fallback kernels."""
    if facts.torch_device_count == 0:
        return Check(name="cudnn", verdict="ok", reason="Not needed: no GPU is visible.")
    if facts.cudnn_available:
        version = f" {facts.cudnn_version}" if facts.cudnn_version else ""
        return Check(name="cudnn", verdict="ok", reason=f"cuDNN{version} is available.")
    major = major_version(facts.torch_cuda_version)
    return Check(
        name="cudnn",
        verdict="warning",
        reason=(
            f"cuDNN is not available to torch {facts.torch_version}: convolutions and RNNs on the GPU "
            "use slower fallback kernels."
        ),
        fix=f"Install a torch build that bundles cuDNN (the official CUDA wheels do) or nvidia-cudnn-cu{major}.",
    )


def check_memory_limit(facts: EnvironmentFacts) -> Check | None:
    """The host memory limit on this process and its headroom, as the strategies read it before step 1 (None: the
    facts do not hold it, as in a file written before it was recorded).

    Example:
        >>> facts = EnvironmentFacts(torch_version="2.13.0+cpu", memory_limit={"limit": None, "used": 0,
        ...     "headroom": None, "source": "none found"})
        >>> check_memory_limit(facts).reason.startswith("No memory limit on this process")
        True
    """
    from stratagem.diagnose.memory import format_bytes

    found = facts.memory_limit
    if found is None:
        return None
    if found.get("limit") is None:
        return Check(
            name="memory_limit",
            verdict="ok",
            reason=(
                "No memory limit on this process (cgroup, RLIMIT_AS, RLIMIT_DATA): the machine's memory is the "
                "bound, and nothing checks a memory plan against it before training."
            ),
        )
    return Check(
        name="memory_limit",
        verdict="ok",
        reason=(
            f"Limit {format_bytes(found['limit'])} ({found['source']}), {format_bytes(found['used'])} used: "
            f"headroom {format_bytes(found['headroom'])}. ShardedStrategy and MultiWorkerMirroredStrategy refuse in "
            "distribute() a memory plan over the headroom."
        ),
    )


@dataclass(frozen=True, kw_only=True)
class DoctorRequest:
    """What ``stratagem doctor`` was asked beyond the machine's facts."""

    requested_gpus: Sequence[int] | None = None
    """GPU indices the user means to use (``--gpus``); None when none were named."""
    memory: Check | None = None
    """The verdict of `stratagem.diagnose.check_memory` on the user's model, when one was estimated."""


@dataclass(frozen=True, kw_only=True)
class DoctorCheck:
    """One check of the doctor: its name, how it is run, and whether it can be why no GPU is used.

    Example:
        >>> [check.name for check in CHECKS if check.explains_no_gpu][:2]
        ['torch_build', 'driver']
    """

    name: str
    """The name of the `Check` it returns."""
    run: Callable[[EnvironmentFacts, DoctorRequest], Check | None]
    """Its verdict on these facts, or None when it was not asked for (no GPU indices, no memory estimate)."""
    explains_no_gpu: bool = False
    """Its failure is a reason torch can use no GPU: `gpu_unavailable_reason` returns the first such failure."""


def _on_facts(
    check: Callable[[EnvironmentFacts], Check | None],
) -> Callable[[EnvironmentFacts, DoctorRequest], Check | None]:
    return lambda facts, request: check(facts)


def _device_index(facts: EnvironmentFacts, request: DoctorRequest) -> Check | None:
    return None if request.requested_gpus is None else check_device_index(facts, request.requested_gpus)


CHECKS: tuple[DoctorCheck, ...] = (
    # Why no GPU, ordered from the most fundamental cause: each later check assumes the earlier ones passed.
    DoctorCheck(name="torch_build", run=_on_facts(check_torch_build), explains_no_gpu=True),
    DoctorCheck(name="driver", run=_on_facts(check_driver), explains_no_gpu=True),
    DoctorCheck(name="driver_version", run=_on_facts(check_driver_version), explains_no_gpu=True),
    DoctorCheck(name="cuda_start", run=_on_facts(check_cuda_start), explains_no_gpu=True),
    DoctorCheck(name="cuda_visible_devices", run=_on_facts(check_cuda_visible_devices), explains_no_gpu=True),
    DoctorCheck(name="nvml_vs_torch", run=_on_facts(check_gpu_visibility), explains_no_gpu=True),
    # What the user asked for, then what multi-GPU training needs.
    DoctorCheck(name="device_index", run=_device_index),
    DoctorCheck(name="memory", run=lambda facts, request: request.memory),
    DoctorCheck(name="memory_limit", run=_on_facts(check_memory_limit)),
    DoctorCheck(name="nccl", run=_on_facts(check_nccl)),
    DoctorCheck(name="cudnn", run=_on_facts(check_cudnn)),
)
"""Every check of ``stratagem doctor``, in the order a person would fix what they find."""


def gpu_unavailable_reason(facts: EnvironmentFacts) -> Check | None:
    """The primary reason torch can use no GPU here, or ``None`` when it can use at least one.

    Example:
        >>> facts = EnvironmentFacts(torch_version="2.3.0+cpu")
        >>> gpu_unavailable_reason(facts).reason
        'torch 2.3.0+cpu is a CPU-only build (torch.version.cuda is None): training runs on the CPU.'
    """
    if facts.torch_device_count > 0:
        return None
    nothing_asked = DoctorRequest()
    for check in CHECKS:
        if check.explains_no_gpu:
            result = check.run(facts, nothing_asked)
            if result is not None and result.verdict != "ok":
                return result
    return _no_gpu_fallback(facts)


def _no_gpu_fallback(facts: EnvironmentFacts) -> Check:
    reports = "the driver reports no GPU" if facts.nvml_device_count == 0 else "the driver is present"
    return Check(
        name="gpu_count",
        verdict="warning",
        reason=f"torch {facts.torch_version} is built for CUDA {facts.torch_cuda_version} and {reports}, "
        "but torch sees no GPU.",
        fix=(
            'Run nvidia-smi to see the GPUs the driver knows, and python -c "import torch; '
            "torch.cuda.init()\" to see CUDA's own error."
        ),
    )


def check_environment(
    facts: EnvironmentFacts, *, requested_gpus: Sequence[int] | None = None, memory: Check | None = None
) -> list[Check]:
    """Runs every check of `CHECKS`, in the order a person would fix them.

    ``requested_gpus`` adds the device-index check; ``memory`` is a check from
    `stratagem.diagnose.check_memory`, added in place.

    Example:
        >>> [c.name for c in check_environment(EnvironmentFacts(torch_version="2.3.0+cpu"))][:4]
        ['torch_build', 'driver', 'driver_version', 'cuda_start']
    """
    request = DoctorRequest(requested_gpus=requested_gpus, memory=memory)
    return [result for check in CHECKS if (result := check.run(facts, request)) is not None]
