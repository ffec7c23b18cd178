"""Why is my GPU not used? Facts about the environment, checks over them, placement decisions.

The checks are pure functions of `EnvironmentFacts`, so every reason can be tested with
constructed facts on a CPU-only machine.

Example:
    >>> from stratagem import diagnose, environ
    >>> facts = diagnose.collect_facts(environ.current())
    >>> [check.name for check in diagnose.check_environment(facts)][:1]
    ['torch_build']
"""

from stratagem.diagnose.checks import (
    check_cuda_visible_devices,
    check_cudnn,
    check_device_index,
    check_driver,
    check_driver_version,
    check_environment,
    check_gpu_visibility,
    check_nccl,
    check_torch_build,
    gpu_unavailable_reason,
    visible_by_cuda_visible_devices,
)
from stratagem.diagnose.cuda_versions import MIN_DRIVER_FOR_CUDA_MAJOR
from stratagem.diagnose.decisions import PlacementDecision
from stratagem.diagnose.facts import EnvironmentFacts, GpuFacts, collect_facts, cpu_count, probe_gpus
from stratagem.diagnose.memory import (
    MemoryEstimate,
    check_memory,
    ensure_fits,
    estimate_training_memory,
    format_bytes,
)
from stratagem.diagnose.placement import (
    CapturedPlacement,
    PlacementLog,
    apply_placement,
    capture_placement,
    log_placement,
    note_replica,
    soft_placement,
)
from stratagem.diagnose.placement_report import CopySummary, OffDeviceOp, PlacementSummary
from stratagem.diagnose.report import DoctorReport, SmokeResult, blocking_checks, exit_code
from stratagem.diagnose.soft_placement import SoftPlacement
from stratagem.diagnose.verdict import Check, Verdict

__all__ = [
    "MIN_DRIVER_FOR_CUDA_MAJOR",
    "CapturedPlacement",
    "Check",
    "CopySummary",
    "DoctorReport",
    "EnvironmentFacts",
    "GpuFacts",
    "MemoryEstimate",
    "OffDeviceOp",
    "PlacementDecision",
    "PlacementLog",
    "PlacementSummary",
    "SmokeResult",
    "SoftPlacement",
    "Verdict",
    "apply_placement",
    "blocking_checks",
    "capture_placement",
    "check_cuda_visible_devices",
    "check_cudnn",
    "check_device_index",
    "check_driver",
    "check_driver_version",
    "check_environment",
    "check_gpu_visibility",
    "check_memory",
    "check_nccl",
    "check_torch_build",
    "collect_facts",
    "cpu_count",
    "ensure_fits",
    "estimate_training_memory",
    "exit_code",
    "format_bytes",
    "gpu_unavailable_reason",
    "log_placement",
    "note_replica",
    "probe_gpus",
    "soft_placement",
    "visible_by_cuda_visible_devices",
]
