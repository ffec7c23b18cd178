"""Every reason a GPU goes unused, checked on constructed facts (so on a CPU-only machine).

Expected verdicts and texts are written out by hand from the facts each test builds.
"""

from __future__ import annotations

import dataclasses

import pytest

from stratagem.diagnose import (
    Check,
    EnvironmentFacts,
    GpuFacts,
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

GiB = 2**30


def cuda_machine(**changes) -> EnvironmentFacts:
    """A healthy machine with two GPUs; each test changes what it diagnoses."""
    facts = EnvironmentFacts(
        torch_version="2.4.0+cu124",
        torch_cuda_version="12.4",
        cuda_runtime_version="12.4",
        driver_present=True,
        driver_version="550.54.15",
        driver_cuda_version="12.4",
        torch_device_count=2,
        nvml_device_count=2,
        nccl_available=True,
        nccl_version="2.20.5",
        cudnn_available=True,
        cudnn_version=90100,
        cpu_count=16,
        gpus=[
            GpuFacts(
                index=i, name="NVIDIA A100-SXM4-40GB", total_memory=40 * GiB, free_memory=39 * GiB, capability=(8, 0)
            )
            for i in range(2)
        ],
    )
    return dataclasses.replace(facts, **changes)


CPU_BOX = EnvironmentFacts(torch_version="2.13.0+cpu", cpu_count=2)


def test_healthy_machine_is_all_ok():
    checks = check_environment(cuda_machine(), requested_gpus=[0, 1])
    assert [(c.name, c.verdict) for c in checks] == [
        ("torch_build", "ok"),
        ("driver", "ok"),
        ("driver_version", "ok"),
        ("cuda_start", "ok"),
        ("cuda_visible_devices", "ok"),
        ("nvml_vs_torch", "ok"),
        ("device_index", "ok"),
        ("nccl", "ok"),
        ("cudnn", "ok"),
    ]
    assert gpu_unavailable_reason(cuda_machine()) is None


# ---- CPU-only build -----------------------------------------------------------------------------


def test_cpu_only_build_without_gpus_is_a_warning():
    check = check_torch_build(CPU_BOX)
    assert check.verdict == "warning"
    assert (
        check.reason == "torch 2.13.0+cpu is a CPU-only build (torch.version.cuda is None): training runs on the CPU."
    )
    assert "install a CUDA build of torch" in check.fix
    assert gpu_unavailable_reason(CPU_BOX) == check


def test_cpu_only_build_with_gpus_present_is_a_problem():
    facts = dataclasses.replace(
        CPU_BOX, driver_present=True, driver_version="535.104.05", driver_cuda_version="12.2", nvml_device_count=4
    )
    check = check_torch_build(facts)
    assert check.verdict == "problem"
    assert check.reason == (
        "torch 2.13.0+cpu is a CPU-only build (torch.version.cuda is None), but the driver "
        "reports 4 GPU(s): they sit idle."
    )
    assert check.fix.startswith("Install a CUDA build of torch for CUDA 12.2 or older")
    assert gpu_unavailable_reason(facts).name == "torch_build"


# ---- CUDA_VISIBLE_DEVICES -----------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["", " ", "-1", "-1,0"])
def test_cuda_visible_devices_hiding_everything(raw):
    facts = cuda_machine(cuda_visible_devices=raw, torch_device_count=0, gpus=[])
    check = check_cuda_visible_devices(facts)
    assert check == Check(
        name="cuda_visible_devices",
        verdict="warning",
        reason=f"CUDA_VISIBLE_DEVICES={raw!r} hides every GPU from torch.",
        fix="Unset it (unset CUDA_VISIBLE_DEVICES) or list the GPUs to use, e.g. CUDA_VISIBLE_DEVICES=0,1.",
    )
    assert gpu_unavailable_reason(facts) == check
    assert visible_by_cuda_visible_devices(facts) == 0


def test_cuda_visible_devices_index_out_of_range():
    facts = cuda_machine(cuda_visible_devices="0,5,1", torch_device_count=1)
    check = check_cuda_visible_devices(facts)
    assert check.verdict == "problem"
    assert check.reason == (
        "CUDA_VISIBLE_DEVICES='0,5,1' has an invalid entry '5' (index 5 is out of range: the "
        "driver reports 2 GPU(s)). CUDA ignores an invalid entry and every entry after it, so "
        "torch sees only 0."
    )
    assert check.fix.startswith("Set CUDA_VISIBLE_DEVICES to comma-separated indices 0..1 or GPU UUIDs")
    assert visible_by_cuda_visible_devices(facts) == 1


def test_cuda_visible_devices_malformed_entry_hides_all():
    facts = cuda_machine(cuda_visible_devices="gpu0", torch_device_count=0, gpus=[])
    check = check_cuda_visible_devices(facts)
    assert check.verdict == "problem"
    assert "invalid entry 'gpu0' (not a GPU index or UUID)" in check.reason
    assert check.reason.endswith("so torch sees no GPU.")
    assert gpu_unavailable_reason(facts) == check


def test_cuda_visible_devices_negative_later_entry():
    check = check_cuda_visible_devices(cuda_machine(cuda_visible_devices="1,-1"))
    assert check.verdict == "problem"
    assert "invalid entry '-1' (a negative index)" in check.reason and "torch sees only 1" in check.reason


def test_cuda_visible_devices_malformed_without_any_gpu_is_a_warning():
    facts = cuda_machine(
        cuda_visible_devices="x",
        driver_present=False,
        driver_version=None,
        driver_cuda_version=None,
        nvml_device_count=None,
        torch_device_count=0,
        gpus=[],
    )
    check = check_cuda_visible_devices(facts)
    assert check.verdict == "warning"
    assert check.fix.startswith("Set CUDA_VISIBLE_DEVICES to comma-separated GPU indices or GPU UUIDs")


def test_cuda_visible_devices_valid_selection_and_uuids():
    assert check_cuda_visible_devices(cuda_machine(cuda_visible_devices="1")).reason == (
        "CUDA_VISIBLE_DEVICES='1' selects 1 GPU(s) of the 2 the driver reports."
    )
    uuid = "GPU-8f6b1d0e-1c2f-4a5b-9c3d-2e1f0a9b8c7d"
    check = check_cuda_visible_devices(cuda_machine(cuda_visible_devices=uuid, nvml_device_count=None))
    assert check.verdict == "ok" and check.reason == f"CUDA_VISIBLE_DEVICES={uuid!r} selects 1 GPU(s)."
    assert check_cuda_visible_devices(cuda_machine()).reason == "CUDA_VISIBLE_DEVICES is not set: every GPU is visible."


# ---- driver -------------------------------------------------------------------------------------


def test_no_driver():
    facts = cuda_machine(
        driver_present=False,
        driver_version=None,
        driver_cuda_version=None,
        nvml_device_count=None,
        torch_device_count=0,
        gpus=[],
    )
    check = check_driver(facts)
    assert check.verdict == "warning"
    assert check.reason == (
        "torch 2.4.0+cu124 is built for CUDA 12.4, but no NVIDIA driver was found (no libcuda, "
        "no /proc/driver/nvidia, no NVML, no nvidia-smi): no GPU can be used."
    )
    assert check.fix == (
        "If this machine has an NVIDIA GPU, install the NVIDIA driver (release 525.60.13 or newer "
        "for CUDA 12.4); in a container, start it with GPU access (docker run --gpus all)."
    )
    assert gpu_unavailable_reason(facts) == check


def test_driver_too_old_for_the_cuda_build():
    facts = cuda_machine(driver_version="470.82.01", driver_cuda_version="11.4", torch_device_count=0, gpus=[])
    check = check_driver_version(facts)
    assert check.verdict == "problem"
    assert check.reason == (
        "NVIDIA driver 470.82.01 is too old for torch 2.4.0+cu124, built for CUDA 12.4: "
        "CUDA 12.x needs driver 525.60.13 or newer."
    )
    assert check.fix == (
        "Update the NVIDIA driver to 525.60.13 or newer, or install a torch build for a CUDA "
        "version that driver 470.82.01 supports (it supports CUDA up to 11.4)."
    )
    assert gpu_unavailable_reason(facts) == check


def test_driver_too_old_for_cuda_11_build():
    facts = cuda_machine(
        torch_version="1.13.1+cu117", torch_cuda_version="11.7", driver_version="440.33.01", driver_cuda_version=None
    )
    check = check_driver_version(facts)
    assert check.verdict == "problem"
    assert "CUDA 11.x needs driver 450.80.02 or newer" in check.reason


def test_driver_cuda_level_too_old_when_release_unknown():
    facts = cuda_machine(driver_version=None, driver_cuda_version="11.8")
    check = check_driver_version(facts)
    assert check.verdict == "problem"
    assert check.reason == (
        "The NVIDIA driver supports CUDA up to 11.8, older than CUDA 12.4 that torch 2.4.0+cu124 is built for."
    )
    assert (
        check.fix == "Update the NVIDIA driver to 525.60.13 or newer, or install a torch build for CUDA 11.8 or older."
    )


def test_driver_under_minor_version_compatibility_is_a_warning():
    facts = cuda_machine(driver_version="530.30.02", driver_cuda_version="12.1")
    check = check_driver_version(facts)
    assert check.verdict == "warning"
    assert check.reason.startswith(
        "The NVIDIA driver supports CUDA up to 12.1 and torch is built for CUDA 12.4: "
        "it runs under minor-version compatibility"
    )


def test_driver_checks_not_applicable_to_cpu_build():
    assert check_driver(CPU_BOX).verdict == "ok"
    assert check_driver_version(CPU_BOX).reason == "Not applicable: no CUDA build or no driver."
    assert check_driver(cuda_machine()).reason == "NVIDIA driver found (release 550.54.15, supports CUDA up to 12.4)."


# ---- NVML sees GPUs torch does not --------------------------------------------------------------


def test_nvml_sees_gpus_torch_does_not():
    facts = cuda_machine(nvml_device_count=4, torch_device_count=2)
    check = check_gpu_visibility(facts)
    assert check.verdict == "problem"
    assert check.reason == "The driver (NVML) reports 4 GPU(s) and 4 should be visible, but torch sees 2."
    assert "/dev/nvidia*" in check.fix


def test_nvml_gpus_hidden_by_cuda_visible_devices_are_expected():
    facts = cuda_machine(nvml_device_count=4, torch_device_count=2, cuda_visible_devices="2,3")
    check = check_gpu_visibility(facts)
    assert check.verdict == "ok"
    assert check.reason == ("torch sees 2 of the 4 GPU(s) the driver reports, as CUDA_VISIBLE_DEVICES='2,3' selects.")


def test_nvml_gpus_with_cpu_only_build_fix_names_the_build():
    facts = dataclasses.replace(CPU_BOX, nvml_device_count=1, driver_present=True)
    check = check_gpu_visibility(facts)
    assert check.verdict == "problem"
    assert check.fix.startswith("torch is a CPU-only build: install a CUDA build of torch")


def test_nvml_unavailable_is_not_checked():
    assert check_gpu_visibility(cuda_machine(nvml_device_count=None)).reason.startswith("Not checked:")


def test_driver_present_but_torch_sees_nothing_falls_back_to_generic_reason():
    facts = cuda_machine(nvml_device_count=0, torch_device_count=0, gpus=[])
    check = gpu_unavailable_reason(facts)
    assert check.name == "gpu_count" and check.verdict == "warning"
    assert check.reason == (
        "torch 2.4.0+cu124 is built for CUDA 12.4 and the driver reports no GPU, but torch sees no GPU."
    )


# ---- requested device index ---------------------------------------------------------------------


def test_requested_index_out_of_range():
    facts = cuda_machine(cuda_visible_devices="0,1")
    check = check_device_index(facts, [0, 3])
    assert check.verdict == "problem"
    assert check.reason == (
        "Requested cuda:3 is out of range: torch sees 2 GPU(s) (cuda:0..cuda:1). "
        "CUDA_VISIBLE_DEVICES='0,1' renumbers the visible GPUs from 0."
    )
    assert check.fix == "Use indices 0..1."


def test_requested_index_with_no_gpu_gives_the_unavailability_fix():
    check = check_device_index(CPU_BOX, [0])
    assert check.verdict == "problem"
    assert check.reason == "Requested cuda:0 is out of range: torch sees 0 GPU(s) (none)."
    assert check.fix == check_torch_build(CPU_BOX).fix


# ---- NCCL and cuDNN -----------------------------------------------------------------------------


def test_nccl_missing_with_several_gpus():
    check = check_nccl(cuda_machine(nccl_available=False, nccl_version=None))
    assert check.verdict == "warning"
    assert check.reason == (
        "torch 2.4.0+cu124 has no NCCL, so all-reduce across the 2 GPUs falls back to reduction "
        "to one device (copy to cuda:0, sum there, copy back), which is slower."
    )
    assert check_nccl(cuda_machine()).reason == "NCCL 2.20.5 is available for all-reduce across GPUs."
    assert check_nccl(cuda_machine(torch_device_count=1, nccl_available=False)).verdict == "ok"


def test_cudnn_missing():
    check = check_cudnn(cuda_machine(cudnn_available=False, cudnn_version=None))
    assert check.verdict == "warning"
    assert check.reason.startswith("cuDNN is not available to torch 2.4.0+cu124")
    assert check.fix.endswith("or nvidia-cudnn-cu12.")
    assert check_cudnn(cuda_machine()).reason == "cuDNN 90100 is available."
    assert check_cudnn(CPU_BOX).verdict == "ok"


# ---- the whole report ---------------------------------------------------------------------------


def test_check_environment_places_optional_checks():
    memory = Check(name="memory", verdict="ok", reason="fits")
    checks = check_environment(cuda_machine(), requested_gpus=[0], memory=memory)
    assert [c.name for c in checks] == [
        "torch_build",
        "driver",
        "driver_version",
        "cuda_start",
        "cuda_visible_devices",
        "nvml_vs_torch",
        "device_index",
        "memory",
        "nccl",
        "cudnn",
    ]


def test_check_message_and_dict():
    check = Check(name="x", verdict="problem", reason="Broken.", fix="Mend it.")
    assert check.message == "Broken. Mend it."
    assert Check(name="x", verdict="ok", reason="Fine.").message == "Fine."
    assert check.to_dict() == {"name": "x", "verdict": "problem", "reason": "Broken.", "fix": "Mend it."}
