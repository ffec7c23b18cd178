"""CUDA start-up failures: kept as facts (never raised), turned into verdicts with fixes.

torch.cuda is mocked to behave as a CUDA build of torch does on a broken machine: is_available()
warns and answers False while device_count() still answers NVML's count, or get_device_properties()
raises. The texts are torch's own for each failure.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import stratagem as sg
from stratagem.cli import doctor
from stratagem.devices import DeviceRegistry
from stratagem.diagnose import (
    EnvironmentFacts,
    check_environment,
    check_gpu_visibility,
    collect_facts,
    gpu_unavailable_reason,
)
from stratagem.diagnose import facts as facts_module
from stratagem.diagnose.cuda_start import check_cuda_start

ERROR_802 = (
    "CUDA initialization: Unexpected error from cudaGetDeviceCount(). Did you run some cuda functions before "
    "calling NumCudaDevices() that might have already set an error? Error 802: system not yet initialized "
    "(Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:109.)"
)
ERROR_804 = (
    "CUDA initialization: Unexpected error from cudaGetDeviceCount(). Did you run some cuda functions before "
    "calling NumCudaDevices() that might have already set an error? Error 804: forward compatibility was "
    "attempted on non supported HW (Triggered internally at ../c10/cuda/CUDAFunctions.cpp:109.)"
)
TOO_OLD = (
    "CUDA initialization: The NVIDIA driver on your system is too old (found version 11040). Please update your "
    "GPU driver by downloading and installing a new version from the URL: http://www.nvidia.com/Download/index.aspx"
)


@pytest.fixture
def broken_cuda(monkeypatch):
    """A CUDA build on a machine with 8 GPUs the driver reports, where CUDA fails to start with `text`."""

    def install(text: str) -> None:
        def is_available() -> bool:
            warnings.warn(text, UserWarning)
            return False

        def fail(*args, **kwargs):
            raise RuntimeError(text.replace("CUDA initialization: ", ""))

        monkeypatch.setattr(torch.version, "cuda", "12.4")
        monkeypatch.setattr(torch.cuda, "is_available", is_available)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # NVML's count, before CUDA starts
        monkeypatch.setattr(torch.cuda, "get_device_properties", fail)
        monkeypatch.setattr(facts_module, "_libcuda_version", lambda: "12.4")
        monkeypatch.setattr(facts_module, "_proc_driver_version", lambda: "550.54.15")
        monkeypatch.setattr(facts_module, "_pynvml", lambda: ("550.54.15", 8))
        monkeypatch.setattr(facts_module, "_nvidia_smi_uuids", lambda: None)
        monkeypatch.setattr(facts_module, "_cuda_runtime_version", lambda version: "12.4")

    return install


def test_a_failed_start_is_a_fact_and_torch_counts_no_gpu(broken_cuda):
    broken_cuda(ERROR_802)
    facts = collect_facts({})
    assert facts.torch_device_count == 0 and facts.gpus == []
    assert facts.cuda_init_error == (
        "Unexpected error from cudaGetDeviceCount(). Did you run some cuda functions before "
        "calling NumCudaDevices() that might have already set an error? Error 802: system "
        "not yet initialized"
    )
    # With torch counting through is_available(), the driver's 8 GPUs against torch's 0 is seen.
    assert check_gpu_visibility(facts).verdict == "problem"


def test_error_802_says_to_start_the_fabric_manager(broken_cuda):
    broken_cuda(ERROR_802)
    check = gpu_unavailable_reason(collect_facts({}))
    assert check.name == "cuda_start" and check.verdict == "problem"
    assert "NVSwitch" in check.reason
    assert check.fix.startswith("Start the NVIDIA Fabric Manager (sudo systemctl enable --now nvidia-fabricmanager)")
    assert "550.54.15" in check.fix


def test_error_804_says_to_drop_the_forward_compatibility_library(broken_cuda):
    broken_cuda(ERROR_804)
    check = check_cuda_start(collect_facts({}))
    assert check.verdict == "problem" and "forward-compatibility" in check.reason
    assert "remove the compat directory from LD_LIBRARY_PATH" in check.fix


def test_a_driver_too_old_says_which_driver_to_install(broken_cuda):
    broken_cuda(TOO_OLD)
    check = check_cuda_start(collect_facts({}))
    assert check.verdict == "problem"
    assert check.reason.endswith("The NVIDIA driver 550.54.15 is too old for torch's CUDA 12.4.")
    assert check.fix.startswith("Update the NVIDIA driver to 525.60.13 or newer")


def test_mig_and_unknown_failures_get_their_own_fixes():
    facts = EnvironmentFacts(
        torch_version="2.4.0+cu124", torch_cuda_version="12.4", cuda_init_error="CUDA error: MIG configuration changed"
    )
    assert "CUDA_VISIBLE_DEVICES=MIG-<uuid>" in check_cuda_start(facts).fix
    facts.cuda_init_error = "CUDA error: unknown error"
    check = check_cuda_start(facts)
    assert check.verdict == "problem" and check.reason == "CUDA failed to start: 'CUDA error: unknown error'."
    assert "torch.cuda.init()" in check.fix
    facts.cuda_init_error = None
    assert check_cuda_start(facts).verdict == "ok"


def test_properties_that_cannot_be_read_are_a_fact_not_a_crash(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def properties(index):
        raise RuntimeError("CUDA error: invalid device ordinal")

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(facts_module, "_probe_driver", lambda facts: None)
    facts = collect_facts({})
    assert facts.gpus == [] and facts.torch_device_count == 0
    assert facts.cuda_init_error == "CUDA error: invalid device ordinal"
    assert [c.verdict for c in check_environment(facts) if c.name == "cuda_start"] == ["problem"]


def test_the_doctor_reports_a_failed_start_and_exits_1(broken_cuda, capsys):
    broken_cuda(ERROR_802)
    code = doctor.run(doctor.add_parser(_subparsers()).parse_args(["--json", "--no-smoke-test"]))
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["exit_code"] == 1
    assert "cuda_start" in report["blocking"]
    assert report["facts"]["cuda_init_error"].endswith("Error 802: system not yet initialized")


def test_the_doctor_survives_a_probe_that_raises_something_unforeseen(monkeypatch, capsys):
    def explode(env):
        raise ZeroDivisionError("probe bug")

    monkeypatch.setattr(doctor, "collect_facts", explode)
    code = doctor.run(doctor.add_parser(_subparsers()).parse_args(["--json", "--no-smoke-test"]))
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    assert report["facts"]["cuda_init_error"] == "collecting the facts failed: ZeroDivisionError: probe bug"


def test_mirrored_strategy_on_a_machine_where_cuda_fails_runs_on_the_cpu_and_says_why(broken_cuda):
    broken_cuda(ERROR_802)
    strategy = sg.MirroredStrategy(registry=DeviceRegistry())
    try:
        assert strategy.num_replicas_in_sync == 1
        reason = next(d.reason for d in strategy.explain().decisions if d.subject == "devices")
        assert "Error 802" in reason and "NVSwitch" in reason
    finally:
        strategy.close()


def _subparsers():
    import argparse

    return argparse.ArgumentParser().add_subparsers()


def test_a_cuda_build_without_a_driver_leaves_the_verdict_to_the_driver_check():
    # torch warns "Found no NVIDIA driver" on a GPU-less machine with a CUDA wheel: a warning there, not a problem.
    facts = EnvironmentFacts(
        torch_version="2.4.0+cu124",
        torch_cuda_version="12.4",
        driver_present=False,
        cuda_init_error="Found no NVIDIA driver on your system. Please check that you have an "
        "NVIDIA GPU and installed a driver from http://www.nvidia.com/Download/index.aspx",
    )
    assert check_cuda_start(facts).verdict == "ok"
    assert gpu_unavailable_reason(facts).name == "driver"
    assert [c.verdict for c in check_environment(facts)].count("problem") == 0
