"""CUDA_VISIBLE_DEVICES read as CUDA reads it, on constructed facts; expected counts written out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from stratagem.diagnose import EnvironmentFacts, check_cuda_visible_devices, visible_by_cuda_visible_devices
from stratagem.diagnose.facts import parse_nvidia_smi_uuids
from stratagem.diagnose.visible_devices import read_visible_devices

GPU0 = "GPU-8f6b1d0e-1c2f-4a5b-9c3d-2e1f0a9b8c7d"
GPU1 = "GPU-1234abcd-0000-4a5b-9c3d-2e1f0a9b8c7d"
MIG_A = "MIG-0f1e2d3c-4b5a-5968-8776-a5b4c3d2e1f0"
MIG_B = "MIG-9a8b7c6d-5e4f-5a3b-8c1d-0e9f8a7b6c5d"

SMI_L = f"""GPU 0: NVIDIA H200 (UUID: {GPU0})
GPU 1: NVIDIA A100-SXM4-40GB (UUID: {GPU1})
  MIG 3g.20gb     Device  0: (UUID: {MIG_A})
  MIG 3g.20gb     Device  1: (UUID: {MIG_B})
"""


def machine(raw: str | None, *, uuids: list[str] | None = None) -> EnvironmentFacts:
    return EnvironmentFacts(
        torch_version="2.4.0+cu124",
        torch_cuda_version="12.4",
        driver_present=True,
        driver_version="550.54.15",
        nvml_device_count=2,
        nvml_uuids=uuids,
        torch_device_count=2,
        cuda_visible_devices=raw,
    )


def test_nvidia_smi_lists_gpu_and_mig_uuids():
    assert parse_nvidia_smi_uuids(SMI_L) == [GPU0, GPU1, MIG_A, MIG_B]


@pytest.mark.parametrize(
    "raw, uuids, expected",
    [
        ("0,1", None, ["0", "1"]),
        ("1,0", None, ["1", "0"]),
        ("0,GPU-x", None, ["0"]),  # CUDA stops at the first invalid entry
        ("GPU-bogus", None, []),  # not hexadecimal: no GPU can have it
        (GPU0[:12], [GPU0, GPU1], [GPU0[:12]]),  # a unique prefix is enough
        ("GPU-", [GPU0, GPU1], []),
        ("GPU-abc", [GPU0, GPU1], []),  # well formed, but the driver lists no such GPU
        (f"{GPU1},0", [GPU0, GPU1], [GPU1, "0"]),
        ("0,0", None, []),  # a GPU named twice: CUDA shows none
        (f"{GPU0},{GPU0.upper().replace('GPU-', 'GPU-')}", [GPU0, GPU1], []),
        (MIG_A, [GPU0, GPU1, MIG_A, MIG_B], [MIG_A]),
        (f"{MIG_A},{MIG_B}", [GPU0, GPU1, MIG_A, MIG_B], [MIG_A]),  # one MIG device per process
        ("MIG-bogus", None, []),
    ],
)
def test_each_form_leaves_what_cuda_would(raw, uuids, expected):
    assert read_visible_devices(raw, driver_count=2, uuids=uuids).visible == expected
    assert visible_by_cuda_visible_devices(machine(raw, uuids=uuids)) == len(expected)


def test_a_bogus_uuid_is_a_problem_that_names_the_entry():
    check = check_cuda_visible_devices(machine("GPU-bogus"))
    assert check.verdict == "problem"
    assert check.reason == (
        "CUDA_VISIBLE_DEVICES='GPU-bogus' has an invalid entry 'GPU-bogus' (not a GPU UUID: a UUID "
        "is hexadecimal digits and dashes). CUDA ignores an invalid entry and every entry after "
        "it, so torch sees no GPU."
    )


def test_a_uuid_the_driver_does_not_list_is_a_problem():
    check = check_cuda_visible_devices(machine("0,GPU-abc", uuids=[GPU0, GPU1]))
    assert check.verdict == "problem"
    assert "'GPU-abc' (no GPU device the driver lists has this UUID (it lists 2))" in check.reason
    assert check.reason.endswith("so torch sees only 0.")


def test_a_repeated_index_hides_every_gpu():
    check = check_cuda_visible_devices(machine("0,0"))
    assert check.verdict == "problem"
    assert check.reason == (
        "CUDA_VISIBLE_DEVICES='0,0' names a GPU twice: '0' and '0' name the same GPU, and CUDA "
        "then shows no GPU at all, so torch sees no GPU."
    )
    assert check.fix == "List each GPU once, e.g. CUDA_VISIBLE_DEVICES=0,1, or unset it."


def test_mig_devices_are_named_and_only_the_first_counts():
    uuids = [GPU0, GPU1, MIG_A, MIG_B]
    assert check_cuda_visible_devices(machine(MIG_A, uuids=uuids)).reason == (
        f"CUDA_VISIBLE_DEVICES={MIG_A!r} selects 1 GPU(s) of the 2 the driver reports, MIG device {MIG_A}."
    )
    check = check_cuda_visible_devices(machine(f"{MIG_A},{MIG_B}", uuids=uuids))
    assert check.verdict == "warning"
    assert check.reason.endswith(f"so torch sees {MIG_A} and not {MIG_B}.")
    assert check.fix.startswith("Run one process per MIG device")


def test_without_gpus_a_malformed_value_is_only_a_warning():
    facts = dataclasses.replace(machine("0,0"), driver_present=False, nvml_device_count=None)
    assert check_cuda_visible_devices(facts).verdict == "warning"
