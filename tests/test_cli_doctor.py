"""``stratagem doctor`` and ``stratagem devices``, run in-process; the exit-code rule on constructed facts."""

from __future__ import annotations

import argparse
import json

from stratagem.cli import devices as devices_command
from stratagem.cli import doctor
from stratagem.diagnose import Check, EnvironmentFacts, GpuFacts, SmokeResult, exit_code

GiB = 2**30
CHECK_NAMES = [
    "torch_build",
    "driver",
    "driver_version",
    "cuda_start",
    "cuda_visible_devices",
    "nvml_vs_torch",
    "memory_limit",
    "nccl",
    "cudnn",
]


def run_command(argv: list[str]) -> int:
    """Parses and runs one of this file's commands as `stratagem.cli.main.main` does."""
    parser = argparse.ArgumentParser(prog="stratagem")
    subparsers = parser.add_subparsers(dest="command")
    for module in (devices_command, doctor):
        module.add_parser(subparsers).set_defaults(_run=module.run)
    args = parser.parse_args(argv)
    return args._run(args)


def json_output(capsys, argv: list[str]) -> tuple[int, dict]:
    code = run_command(argv)
    return code, json.loads(capsys.readouterr().out)


def write_facts(tmp_path, facts: EnvironmentFacts) -> str:
    path = tmp_path / "facts.json"
    path.write_text(json.dumps(facts.to_dict()))
    return str(path)


def test_doctor_json_on_this_machine(capsys):
    code, report = json_output(capsys, ["doctor", "--json"])
    assert set(report) == {"exit_code", "blocking", "checks", "mirrored_strategy", "smoke_test", "facts"}
    assert [c["name"] for c in report["checks"]] == CHECK_NAMES
    assert all(set(c) == {"name", "verdict", "reason", "fix"} for c in report["checks"])
    assert all(c["verdict"] in ("ok", "warning", "problem") for c in report["checks"])
    assert set(report["mirrored_strategy"]["decision"]) == {"subject", "choice", "reason"}
    assert report["mirrored_strategy"]["devices"]
    assert all(step["passed"] for step in report["smoke_test"])
    assert code == report["exit_code"]
    assert report["blocking"] == [c["name"] for c in report["checks"] if c["verdict"] == "problem"]


def test_doctor_smoke_test_across_two_logical_cpus(capsys):
    code, report = json_output(capsys, ["doctor", "--json", "--devices", "cpu:0,/cpu:1"])
    assert report["mirrored_strategy"]["devices"] == ["cpu:0", "cpu:1"]
    assert [(s["name"], s["passed"]) for s in report["smoke_test"]] == [
        ("all-reduce across cpu:0, cpu:1", True),
        ("training step on cpu:0", True),
        ("training step on cpu:1", True),
    ]
    # Replicas contribute 1 and 2: the sum is 3 in every element.
    assert report["smoke_test"][0]["detail"] == "sum over 2 replica(s) = [3.0, 3.0, 3.0]"


def test_doctor_text_report(capsys):
    code = run_command(["doctor", "--no-smoke-test"])
    out = capsys.readouterr().out
    assert "stratagem doctor" in out and "torch_build" in out
    assert "MirroredStrategy() would use:" in out
    assert "skipped: --no-smoke-test" in out
    assert ("Nothing blocks training. (exit code 0)" in out) == (code == 0)


def test_doctor_bad_devices_is_a_usage_error(capsys):
    assert run_command(["doctor", "--devices", "cpu:0,cpu:9"]) == 2
    assert "stratagem doctor: Device 'cpu:9' is out of range" in capsys.readouterr().err


def test_doctor_unreadable_facts_file(tmp_path, capsys):
    path = tmp_path / "facts.json"
    path.write_text(json.dumps([1, 2]))
    assert run_command(["doctor", "--facts", str(path)]) == 2
    assert "does not hold stratagem facts" in capsys.readouterr().err
    assert run_command(["doctor", "--facts", str(tmp_path / "missing.json")]) == 2
    assert "No such file" in capsys.readouterr().err


# ---- the exit-code rule, on facts recorded elsewhere ---------------------------------------------


def test_cpu_only_build_on_a_cpu_machine_does_not_block(tmp_path, capsys):
    facts = EnvironmentFacts(torch_version="2.13.0+cpu", cpu_count=2)
    code, report = json_output(capsys, ["doctor", "--json", "--facts", write_facts(tmp_path, facts)])
    assert code == 0 and report["exit_code"] == 0 and report["blocking"] == []
    assert report["checks"][0]["verdict"] == "warning"
    assert report["mirrored_strategy"]["devices"] == ["cpu:0"]
    assert "torch 2.13.0+cpu is a CPU-only build" in report["mirrored_strategy"]["decision"]["reason"]
    assert report["smoke_test"] == [
        {"name": "smoke test", "passed": None, "detail": "skipped: facts were loaded from a file"}
    ]


def test_malformed_cuda_visible_devices_with_gpus_blocks(tmp_path, capsys):
    facts = EnvironmentFacts(
        torch_version="2.4.0+cu124",
        torch_cuda_version="12.4",
        driver_present=True,
        driver_version="550.54.15",
        cuda_visible_devices="gpu1",
        nvml_device_count=2,
        cpu_count=8,
    )
    code, report = json_output(capsys, ["doctor", "--json", "--facts", write_facts(tmp_path, facts)])
    assert code == 1
    assert report["blocking"] == ["cuda_visible_devices"]  # NVML vs torch is explained by it: ok
    assert "'gpu1'" in report["mirrored_strategy"]["decision"]["reason"]


def test_gpu_machine_recorded_elsewhere_uses_every_gpu(tmp_path, capsys):
    facts = EnvironmentFacts(
        torch_version="2.4.0+cu124",
        torch_cuda_version="12.4",
        driver_present=True,
        driver_version="550.54.15",
        torch_device_count=2,
        nvml_device_count=2,
        nccl_available=False,
        cudnn_available=True,
        cpu_count=8,
        gpus=[GpuFacts(index=i, name="Test GPU", total_memory=8 * GiB) for i in range(2)],
    )
    report_file = tmp_path / "report.json"
    report_file.write_text(json.dumps({"facts": facts.to_dict()}))  # a whole --json report is accepted too
    code, report = json_output(capsys, ["doctor", "--json", "--facts", str(report_file)])
    assert code == 0  # no NCCL is a warning: training runs, all-reduce goes through one device
    assert report["mirrored_strategy"]["devices"] == ["cuda:0", "cuda:1"]
    assert [c["verdict"] for c in report["checks"] if c["name"] == "nccl"] == ["warning"]


def test_failed_smoke_step_blocks_and_skipped_does_not():
    warning = Check(name="torch_build", verdict="warning", reason="CPU-only build.")
    problem = Check(name="driver_version", verdict="problem", reason="Too old.")
    assert exit_code([warning]) == 0
    assert exit_code([warning, problem]) == 1
    assert exit_code([warning], [SmokeResult(name="all-reduce", passed=False, detail="got 2, expected 3")]) == 1
    assert exit_code([warning], [SmokeResult(name="smoke test", passed=None, detail="skipped")]) == 0


# ---- stratagem devices ---------------------------------------------------------------------------


def test_devices_json(capsys):
    code, report = json_output(capsys, ["devices", "--json"])
    assert code == 0
    assert set(report) == {"physical", "logical", "no_gpu_reason"}
    assert report["physical"][0]["device_type"] == "cpu" and report["physical"][0]["core_count"] >= 1
    assert report["logical"][0] == {"name": "cpu:0", "physical": "cpu", "memory_limit": None}
    if not any(d["device_type"] == "cuda" for d in report["physical"]):
        assert report["no_gpu_reason"]["verdict"] in ("warning", "problem")


def test_devices_text(capsys):
    assert run_command(["devices"]) == 0
    out = capsys.readouterr().out
    assert "Physical devices" in out and "Logical devices" in out and "cpu:0" in out


# ---- through the real entry point ------------------------------------------------------------------


def test_main_dispatches_doctor_and_devices(capsys):
    from stratagem.cli.main import main

    assert main(["doctor", "--json", "--no-smoke-test"]) == json.loads(capsys.readouterr().out)["exit_code"]
    assert main(["devices", "--json"]) == 0


def test_the_memory_limit_and_its_headroom_are_shown_from_the_facts(tmp_path, capsys):
    limited = EnvironmentFacts(
        torch_version="2.13.0+cpu",
        memory_limit={"limit": 4 * GiB, "used": GiB, "headroom": 3 * GiB, "source": "cgroup v1 /job (memory.limit_in_bytes)"},
    )  # fmt: skip
    code, report = json_output(capsys, ["doctor", "--json", "--facts", write_facts(tmp_path, limited)])
    (check,) = [c for c in report["checks"] if c["name"] == "memory_limit"]
    assert check["verdict"] == "ok" and code == 0
    assert check["reason"].startswith(
        "Limit 4.00 GiB (cgroup v1 /job (memory.limit_in_bytes)), 1.00 GiB used: headroom 3.00 GiB."
    )
    assert report["facts"]["memory_limit"]["headroom"] == 3 * GiB
    unlimited = EnvironmentFacts(
        torch_version="2.13.0+cpu", memory_limit={"limit": None, "used": 0, "headroom": None, "source": "none found"}
    )
    code, report = json_output(capsys, ["doctor", "--json", "--facts", write_facts(tmp_path, unlimited)])
    (check,) = [c for c in report["checks"] if c["name"] == "memory_limit"]
    assert check["reason"].startswith("No memory limit on this process")
    # Facts recorded before the limit was: no check, rather than a guess.
    code, report = json_output(
        capsys, ["doctor", "--json", "--facts", write_facts(tmp_path, EnvironmentFacts(torch_version="2.13.0+cpu"))]
    )
    assert "memory_limit" not in [c["name"] for c in report["checks"]]


def test_the_doctor_reads_this_processs_real_rlimit(tmp_path):
    import resource
    import subprocess
    import sys

    limit = 256 * GiB  # RLIMIT_AS, far above what `stratagem doctor` maps, so it runs

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    out = subprocess.run(
        [sys.executable, "-m", "stratagem", "doctor", "--json", "--no-smoke-test"],
        preexec_fn=limited, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    report = json.loads(out.stdout)
    found = report["facts"]["memory_limit"]
    # The tightest limit wins: a cgroup's, where one is tighter than 256 GiB of address space, else this one.
    if found["source"].startswith("RLIMIT_AS"):
        assert found["limit"] == limit and 0 < found["used"] < limit and found["headroom"] == limit - found["used"]
    else:
        assert found["headroom"] < limit - found["used"], found
    (check,) = [c for c in report["checks"] if c["name"] == "memory_limit"]
    assert check["reason"].startswith("Limit ")
