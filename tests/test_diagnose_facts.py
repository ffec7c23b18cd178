"""Collecting facts: on this machine, and each probe on faked driver answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import torch

from stratagem.diagnose import EnvironmentFacts, GpuFacts, collect_facts, probe_gpus
from stratagem.diagnose import facts as facts_module


def test_collect_facts_on_this_machine():
    facts = collect_facts({})
    assert facts.torch_version == torch.__version__
    assert facts.torch_cuda_version == torch.version.cuda
    assert facts.cuda_visible_devices is None
    if hasattr(os, "sched_getaffinity"):
        assert facts.cpu_count == len(os.sched_getaffinity(0))
    if torch.version.cuda is None:
        assert (facts.torch_device_count, facts.gpus, facts.nccl_available) == (0, [], False)
        assert probe_gpus() == []
    json.dumps(facts.to_dict())


def test_cuda_visible_devices_comes_from_the_env_argument():
    assert collect_facts({"CUDA_VISIBLE_DEVICES": ""}).cuda_visible_devices == ""
    assert collect_facts({"CUDA_VISIBLE_DEVICES": "1,0"}).cuda_visible_devices == "1,0"


def test_round_trip_through_json():
    facts = EnvironmentFacts(
        torch_version="2.4.0+cu124",
        torch_cuda_version="12.4",
        torch_device_count=1,
        gpus=[GpuFacts(index=0, name="Test GPU", total_memory=8, free_memory=4, capability=(9, 0))],
    )
    assert EnvironmentFacts.from_dict(json.loads(json.dumps(facts.to_dict()))) == facts
    # Fields added by a newer stratagem are ignored rather than rejected.
    assert EnvironmentFacts.from_dict({"torch_version": "2.0.0", "future_field": 1}).torch_version == "2.0.0"


def test_proc_driver_version_both_kernel_modules():
    proprietary = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
    open_module = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build\n"
    assert facts_module.parse_proc_driver_version(proprietary) == "535.104.05"
    assert facts_module.parse_proc_driver_version(open_module) == "550.54.15"
    assert facts_module.parse_proc_driver_version("garbage") is None


def test_nvidia_smi_answers(monkeypatch):
    monkeypatch.setattr(facts_module.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    calls = []

    def fake_run(command, **kwargs):
        calls.append((command, kwargs["timeout"]))
        return subprocess.CompletedProcess(command, 0, stdout="550.54.15\n550.54.15\n", stderr="")

    monkeypatch.setattr(facts_module.subprocess, "run", fake_run)
    assert facts_module._nvidia_smi() == ("550.54.15", 2)
    assert calls == [
        (
            ["/usr/bin/nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            facts_module.NVIDIA_SMI_TIMEOUT_S,
        )
    ]


def test_nvidia_smi_hang_or_failure_gives_nothing(monkeypatch):
    monkeypatch.setattr(facts_module.shutil, "which", lambda name: "/usr/bin/nvidia-smi")

    def hang(command, **kwargs):
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(facts_module.subprocess, "run", hang)
    assert facts_module._nvidia_smi() == (None, None)
    monkeypatch.setattr(
        facts_module.subprocess,
        "run",
        lambda command, **kwargs: subprocess.CompletedProcess(
            command, 9, stdout="", stderr="NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"
        ),
    )
    assert facts_module._nvidia_smi() == (None, None)
    monkeypatch.setattr(facts_module.shutil, "which", lambda name: None)
    assert facts_module._nvidia_smi() == (None, None)


def test_pynvml_answers(monkeypatch):
    events = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: events.append("init"),
        nvmlSystemGetDriverVersion=lambda: b"550.54.15",
        nvmlDeviceGetCount=lambda: 8,
        nvmlShutdown=lambda: events.append("shutdown"),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert facts_module._pynvml() == ("550.54.15", 8)
    assert events == ["init", "shutdown"]


def test_pynvml_without_driver(monkeypatch):
    def fail():
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=fail))
    assert facts_module._pynvml() == (None, None)


def test_libcuda_version(monkeypatch):
    class FakeLibcuda:
        @staticmethod
        def cuDriverGetVersion(pointer):
            pointer._obj.value = 12040  # what a driver supporting CUDA 12.4 reports
            return 0

    monkeypatch.setattr(facts_module.sys, "platform", "linux")
    monkeypatch.setattr(facts_module.ctypes, "CDLL", lambda name: FakeLibcuda())
    assert facts_module._libcuda_version() == "12.4"

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(facts_module.ctypes, "CDLL", missing)
    assert facts_module._libcuda_version() is None


def test_driver_probe_combines_sources(monkeypatch):
    monkeypatch.setattr(facts_module, "_libcuda_version", lambda: "12.4")
    monkeypatch.setattr(facts_module, "_proc_driver_version", lambda: None)
    monkeypatch.setattr(facts_module, "_pynvml", lambda: (None, None))
    monkeypatch.setattr(facts_module, "_nvidia_smi", lambda: ("550.54.15", 2))
    facts = EnvironmentFacts(torch_version="2.4.0+cu124")
    facts_module._probe_driver(facts)
    assert (facts.driver_present, facts.driver_version, facts.driver_cuda_version, facts.nvml_device_count) == (
        True,
        "550.54.15",
        "12.4",
        2,
    )
