"""`stratagem bench`: the scaling arithmetic on hand-worked numbers, the plan for machines we do not
have (GPUs), clear errors for bad options, and one real end-to-end run with a tiny configuration."""

from __future__ import annotations

import json
import re
import zlib

import pytest

from stratagem.bench.measure import MeasureRequest, measure_rank
from stratagem.bench.registry import BenchMachine, BenchStrategy
from stratagem.bench.scaling import (
    ScalingConfig,
    ScalingRow,
    _failure_reason,
    _fill_scaling,
    default_replica_counts,
    plan_rows,
    ratio_to_plain,
    run_scaling,
    scaling_figures,
)
from stratagem.cli.main import main
from stratagem.errors import InputError
from stratagem.strategies.records import STRATEGIES

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_text_chunks(data: bytes) -> dict[str, str]:
    """The tEXt chunks of a PNG (keyword -> text), read with the format's own layout."""
    assert data[:8] == PNG_SIGNATURE
    chunks, offset = {}, 8
    while offset < len(data):
        length = int.from_bytes(data[offset : offset + 4], "big")
        kind = data[offset + 4 : offset + 8]
        body = data[offset + 8 : offset + 8 + length]
        crc = int.from_bytes(data[offset + 8 + length : offset + 12 + length], "big")
        assert zlib.crc32(kind + body) == crc, f"corrupt {kind!r} chunk"
        if kind == b"tEXt":
            key, _, text = body.partition(b"\0")
            chunks[key.decode("latin-1")] = text.decode("latin-1")
        offset += 12 + length
    assert kind == b"IEND"
    return chunks


# ---- arithmetic, worked by hand ----------------------------------------------------------------


def test_ratio_is_against_the_mean_of_the_rounds_plain_runs():
    # plain ran at 1000 and 800 samples/s around the configuration: mean 900.
    assert ratio_to_plain(900.0, [1000.0, 800.0]) == pytest.approx(1.0)
    assert ratio_to_plain(450.0, [1000.0, 800.0]) == pytest.approx(0.5)


def test_efficiency_divides_the_speedup_by_the_hardware_added():
    # 4 GPUs: 3000 vs 1000 samples/s is 3x of an ideal 4x.
    assert scaling_figures(3000.0, 1000.0, "gpu", 4) == pytest.approx((3.0, 4, 0.75))
    # 2 logical CPUs share the cores of one: 1800 vs 2000 samples/s is 0.9x of an ideal 1x.
    assert scaling_figures(1800.0, 2000.0, "cpu", 2) == pytest.approx((0.9, 1, 0.9))


def test_default_replica_counts_double_up_to_the_device_count():
    assert default_replica_counts(1) == [1]
    assert default_replica_counts(2) == [1, 2]
    assert default_replica_counts(6) == [1, 2, 4, 6]
    assert default_replica_counts(8) == [1, 2, 4, 8]
    assert default_replica_counts(0) == []


def test_rows_report_medians_and_scaling_against_their_own_one_replica_run():
    one = ScalingRow(
        workload="mlp",
        strategy="mirrored",
        kind="gpu",
        replicas=1,
        devices=["cuda:0"],
        status="ok",
        samples_per_s_runs=[1000.0, 1200.0, 1100.0],
        ratios_runs=[0.9, 1.0, 0.95],
    )
    two = ScalingRow(
        workload="mlp",
        strategy="mirrored",
        kind="gpu",
        replicas=2,
        devices=["cuda:0", "cuda:1"],
        status="ok",
        samples_per_s_runs=[2000.0, 1900.0, 1500.0],
        ratios_runs=[1.8, 1.6, 1.7],
    )
    failed = ScalingRow(
        workload="mlp",
        strategy="multi_worker",
        kind="gpu",
        replicas=2,
        devices=["cuda:0", "cuda:1"],
        status="failed",
        reason="boom",
        samples_per_s_runs=[5000.0],
    )
    _fill_scaling([one, two, failed])
    assert (one.samples_per_s, one.ratio_vs_plain) == (1100.0, 0.95)
    assert (two.samples_per_s, two.ratio_vs_plain) == (1900.0, 1.7)
    assert two.speedup == pytest.approx(1900 / 1100)
    assert two.ideal_speedup == 2
    assert two.scaling_efficiency == pytest.approx(1900 / 1100 / 2)
    # A failed configuration shows no figure, not the one of a round that happened to finish.
    assert failed.samples_per_s is None and failed.speedup is None
    assert failed.to_dict()["reason"] == "boom"


# ---- the plan: every configuration listed, those that cannot run say why --------------------------


def test_plan_on_a_machine_with_gpus_measures_both_kinds():
    machine = BenchMachine(cpu_devices=2, gpu_devices=2, gloo=True, nccl=True)
    rows = plan_rows(ScalingConfig(workloads=("mlp",), strategies=("one_device", "mirrored", "multi_worker")), machine)
    table = {(r.kind, r.strategy, r.replicas): r for r in rows}
    assert [key for key in table if key[0] == "gpu"] == [
        ("gpu", "plain", 1),
        ("gpu", "one_device", 1),
        ("gpu", "one_device", 2),
        ("gpu", "mirrored", 1),
        ("gpu", "mirrored", 2),
        ("gpu", "multi_worker", 1),
        ("gpu", "multi_worker", 2),
    ]
    assert table[("gpu", "plain", 1)].devices == ["cuda:0"]
    assert table[("gpu", "mirrored", 2)].devices == ["cuda:0", "cuda:1"]
    assert table[("gpu", "multi_worker", 2)].devices == ["cuda:0", "cuda:1"]
    assert table[("cpu", "multi_worker", 2)].devices == ["cpu:0", "cpu:0"]  # one process each, on the CPU
    assert table[("gpu", "one_device", 2)].status == "unavailable"
    assert table[("gpu", "one_device", 2)].reason == "one_device runs at most 1 replica(s)"
    assert {r.status for r in rows if r.strategy != "one_device" or r.replicas == 1} == {"pending"}


def test_sharded_runs_two_replicas_as_two_processes_of_one_device_each():
    # Before (issue 38): the record's max_devices=1, a cap on each worker's devices, was read as a cap on replicas,
    # so `stratagem bench` never measured sharded x2 ("sharded runs at most 1 replica(s)").
    machine = BenchMachine(cpu_devices=2, gpu_devices=2, gloo=True, nccl=True)
    rows = plan_rows(ScalingConfig(workloads=("mlp",), strategies=("sharded", "one_device")), machine)
    table = {(r.kind, r.strategy, r.replicas): r for r in rows}
    for kind, devices in (("cpu", ["cpu:0", "cpu:0"]), ("gpu", ["cuda:0", "cuda:1"])):
        assert table[(kind, "sharded", 2)].status == "pending", table[(kind, "sharded", 2)].reason
        assert table[(kind, "sharded", 2)].devices == devices
    assert table[("cpu", "one_device", 2)].reason == "one_device runs at most 1 replica(s)"  # a cap of its own
    assert BenchStrategy.from_record(STRATEGIES["sharded"]).max_replicas is None


def test_plan_says_why_a_configuration_cannot_run_here():
    machine = BenchMachine(cpu_devices=2, gpu_devices=4, gloo=True, nccl=False)
    rows = plan_rows(ScalingConfig(workloads=("cnn",), strategies=("mirrored", "multi_worker"), replicas=(4,)), machine)
    reasons = {(r.kind, r.strategy): r.reason for r in rows if r.strategy != "plain"}
    assert reasons[("cpu", "mirrored")] == "this machine has 2 logical CPU device(s), fewer than 4 replicas"
    assert reasons[("gpu", "mirrored")] is None
    assert reasons[("gpu", "multi_worker")] == "torch.distributed has no nccl backend in this torch build"


def test_a_strategy_the_benchmark_cannot_build_is_refused_with_its_name():
    no_bench = STRATEGIES["model_parallel"]  # its record gives no bench_build
    with pytest.raises(InputError, match=r"Received: 'model_parallel' with bench_build=None\. Give its StrategyRecord"):
        BenchStrategy.from_record(no_bench)


def test_a_replica_count_no_device_kind_has_is_refused_before_any_work():
    with pytest.raises(
        InputError,
        match=r"more replicas than this machine has devices \(2 logical CPU device\(s\), "
        r"0 GPU\(s\)\)\. Received: replicas=\(1, 3\)\. Use counts up to 2",
    ):
        plan_rows(ScalingConfig(strategies=("mirrored",), replicas=(1, 3)), BenchMachine(cpu_devices=2))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"workloads": ("mlp", "resnet")},
            (
                r"Unknown workloads: \['resnet'\]\. Received: workloads=\('mlp', 'resnet'\)\. "
                r"Use some of \['cnn', 'mlp'\]"
            ),
        ),
        ({"workloads": ()}, r"workloads must be a non-empty list of names\. Received: workloads=\(\)"),
        ({"strategies": ("mirored",)}, r"Unknown strategies: \['mirored'\]\. .* Use some of \['central_storage', "),
        ({"strategies": ("mirrored", "mirrored")}, r"strategies lists a name twice\. Received: strategies="),
        ({"replicas": (0, 1)}, r"replicas must be positive whole numbers\. Received: replicas=\(0, 1\)"),
        ({"replicas": (2, 2)}, r"replicas lists a count twice\. Received: replicas=\(2, 2\)"),
        ({"steps": 0}, r"steps must be a whole number >= 1\. Received: steps=0"),
        ({"warmup": -1}, r"warmup must be a whole number >= 0\. Received: warmup=-1"),
        ({"rounds": 0}, r"rounds must be a whole number >= 1\. Received: rounds=0"),
        ({"timeout_s": 0}, r"timeout_s must be a finite number of seconds in \(0, 86400\]\. Received: timeout_s=0"),
    ],
)
def test_bad_configuration_is_refused_with_the_value(options, message):
    with pytest.raises(InputError, match=message):
        ScalingConfig(**options)


# ---- the command: bad options -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workloads", "mlp,vgg"], r"stratagem bench: Unknown workloads: \['vgg'\]"),
        (["--strategies", "parameter_server"], r"Unknown strategies: \['parameter_server'\]"),
        (["--replicas", "1,64"], r"more replicas than this machine has devices .* Received: replicas=\(1, 64\)"),
        (["--steps", "0"], r"steps must be a whole number >= 1\. Received: steps=0"),
        (
            ["--quick", "--timeout", "-1"],
            r"timeout_s must be a finite number of seconds in \(0, 86400\]\. Received: timeout_s=-1",
        ),
    ],
)
def test_bad_values_exit_2_with_the_reason(capsys, tmp_path, argv, message):
    assert main(["bench", "--out", str(tmp_path), *argv]) == 2
    assert list(tmp_path.iterdir()) == []  # nothing measured, nothing written
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--replicas", "one,two"],
            (
                r"argument --replicas: replica counts must be whole numbers separated by commas\. "
                r"Received: 'one,two'\. Use e\.g\. 1,2"
            ),
        ),
        (["--workloads", ","], r"argument --workloads: expected comma-separated names\. Received: ','"),
        (["--steps", "ten"], r"argument --steps: expected a whole number\. Received: 'ten'"),
    ],
)
def test_malformed_options_are_argparse_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_output_paths_are_checked_before_measuring(capsys, tmp_path):
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    assert main(["bench", "--out", str(a_file)]) == 2
    assert "--out must be a directory. Received: --out " in capsys.readouterr().err
    assert main(["bench", "--out", str(tmp_path), "--save-json", str(tmp_path / "no" / "r.json")]) == 2
    assert "--save-json: cannot write into " in capsys.readouterr().err
    assert main(["bench", "--out", str(tmp_path), "--plot", str(tmp_path)]) == 2
    assert "--plot must be a file path. Received: --plot " in capsys.readouterr().err


# ---- failures become rows with their reason ------------------------------------------------------


def test_the_table_shows_figures_and_the_reason_of_every_row_not_measured():
    from rich.console import Console

    from stratagem.bench.scaling import ScalingReport
    from stratagem.cli.bench import _table

    rows = [
        ScalingRow(
            workload="mlp",
            strategy="plain",
            kind="cpu",
            replicas=1,
            devices=["cpu"],
            status="ok",
            samples_per_s_runs=[10000.0, 9000.0],
            ratios_runs=[1.0],
            final_loss=0.5,
        ),
        ScalingRow(
            workload="mlp",
            strategy="mirrored",
            kind="cpu",
            replicas=2,
            devices=["cpu:0", "cpu:1"],
            status="ok",
            samples_per_s_runs=[8550.0],
            ratios_runs=[0.9],
            final_loss=0.5,
            speedup=0.95,
            ideal_speedup=1,
            scaling_efficiency=0.95,
        ),
        ScalingRow(
            workload="mlp",
            strategy="multi_worker",
            kind="cpu",
            replicas=2,
            devices=["cpu:0", "cpu:0"],
            status="failed",
            reason="rank 1: CollectiveTimeoutError: worker:0 (rank 0) missing",
        ),
        ScalingRow(
            workload="mlp",
            strategy="one_device",
            kind="cpu",
            replicas=2,
            devices=["cpu:0", "cpu:1"],
            status="unavailable",
            reason="one_device runs at most 1 replica(s)",
        ),
    ]
    report = ScalingReport(config=ScalingConfig(), machine=BenchMachine(cpu_devices=2), rows=rows, elapsed_s=1.0)
    console = Console(width=250, record=True)
    console.print(_table(report))
    lines = console.export_text().splitlines()
    assert any("plain" in line and "9,500" in line and "1.000" in line and "baseline" in line for line in lines)
    assert any("mirrored" in line and "8,550" in line and "0.900" in line and "0.95" in line for line in lines)
    assert any("failed: rank 1: CollectiveTimeoutError: worker:0 (rank 0) missing" in line for line in lines)
    assert any("unavailable: one_device runs at most 1 replica(s)" in line for line in lines)
    assert report.failed == [rows[2]]


def test_a_rank_that_raises_leaves_its_reason_for_the_table(tmp_path):
    request = MeasureRequest(
        strategy="mirrored", kind="cpu", replicas=1, workload="nope", warmup=0, steps=1, timeout_s=10
    )
    with pytest.raises(SystemExit):
        measure_rank(0, request, [], str(tmp_path), queue=None)
    reason = _failure_reason(RuntimeError("a benchmark rank failed: exit codes [1]"), str(tmp_path), 1, 0.1, 10)
    assert reason == "KeyError: 'nope'"


@pytest.mark.timeout(60)
def test_a_configuration_past_its_timeout_is_stopped_and_reported():
    # 1000 CNN steps take minutes on a CPU (about 0.1 s each on 2 cores): 0.5 s cannot be enough.
    report = run_scaling(
        ScalingConfig(
            workloads=("cnn",), strategies=("one_device",), replicas=(1,), warmup=0, steps=1000, timeout_s=0.5
        )
    )
    assert [(row.strategy, row.status) for row in report.rows] == [("plain", "failed"), ("one_device", "failed")]
    assert report.rows[0].reason.startswith("did not finish within timeout_s=0.5 s and was stopped")
    assert report.failed == report.rows


# ---- end to end -----------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_bench_measures_writes_png_and_json_and_matches_plain_losses(capsys, tmp_path):
    argv = [
        "bench",
        "--json",
        "--workloads",
        "mlp",
        "--strategies",
        "mirrored,multi_worker",
        "--replicas",
        "1,2",
        "--warmup",
        "1",
        "--steps",
        "2",
        "--out",
        str(tmp_path),
    ]
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    printed = json.loads(captured.out)
    assert json.loads((tmp_path / "stratagem-bench.json").read_text()) == printed
    assert {
        "config",
        "machine",
        "definitions",
        "results",
        "elapsed_s",
        "files",
        "warnings",
        "trusted",
    } <= printed.keys()
    # On a shared machine the run may be flagged; whatever it says is in the JSON and on standard error.
    assert printed["trusted"] == (not printed["warnings"])
    for warning in printed["warnings"]:
        assert f"stratagem bench: warning: {warning}" in captured.err
    assert printed["config"]["steps"] == 2 and printed["machine"]["cpu_devices"] >= 2
    assert printed["machine"]["gpu_devices"] > 0 or "CPU" in printed["machine"]["no_gpu_reason"]
    rows = {(r["strategy"], r["replicas"]): r for r in printed["results"] if r["device_kind"] == "cpu"}
    assert set(rows) == {("plain", 1), ("mirrored", 1), ("mirrored", 2), ("multi_worker", 1), ("multi_worker", 2)}
    plain = rows[("plain", 1)]
    assert len(plain["samples_per_s_runs"]) == 2  # first and last of the round
    for key, row in rows.items():
        assert row["status"] == "ok", (key, row["reason"])
        assert row["samples_per_s"] > 0 and row["ratio_vs_plain"] > 0
        assert row["peak_memory_bytes"] > 0, key  # beside samples/s for every strategy (issue 39, item 7)
        # Synchronous strategies train the same model on the same global batches: the loss of plain PyTorch.
        assert row["final_loss"] == pytest.approx(plain["final_loss"], rel=1e-5), key
        if key[0] != "plain":
            assert row["ideal_speedup"] == 1 and row["scaling_efficiency"] == pytest.approx(row["speedup"])
    assert rows[("mirrored", 1)]["speedup"] == 1.0
    png = (tmp_path / "stratagem-bench.png").read_bytes()
    assert "matplotlib" in png_text_chunks(png).get("Software", "").lower()
    assert len(png) > 10_000  # axes, lines and labels, not an empty canvas


def test_worker_processes_on_the_cpu_are_measured_at_one_two_and_three_on_two_cores():
    # Issue 39, item 7: memory per rank against worker count needs three points, also on a 2-core machine.
    machine = BenchMachine(cpu_devices=2, gloo=True)
    rows = plan_rows(ScalingConfig(workloads=("mlp",), strategies=("sharded", "multi_worker", "mirrored")), machine)
    counts = {
        name: [r.replicas for r in rows if r.strategy == name] for name in ("sharded", "multi_worker", "mirrored")
    }
    assert counts == {"sharded": [1, 2, 3], "multi_worker": [1, 2, 3], "mirrored": [1, 2]}
    assert all(r.status == "pending" for r in rows), [(r.label, r.reason) for r in rows]
    three = plan_rows(ScalingConfig(strategies=("sharded", "mirrored"), replicas=(3,)), machine)
    reasons = {r.strategy: r.reason for r in three if r.workload == "mlp"}
    assert reasons == {
        "plain": None,
        "sharded": None,
        "mirrored": "this machine has 2 logical CPU device(s), fewer than 3 replicas",
    }
    with pytest.raises(
        InputError, match=r"\(2 logical CPU device\(s\), 0 GPU\(s\); worker processes on the CPU: up to 3\)"
    ):
        plan_rows(ScalingConfig(strategies=("sharded",), replicas=(4,)), machine)


@pytest.mark.timeout(240)
def test_bench_measures_sharded_at_two_and_three_workers_with_memory_per_rank(capsys, tmp_path):
    argv = ["bench", "--json", "--workloads", "mlp", "--strategies", "sharded,multi_worker", "--replicas", "2,3"]
    code = main([*argv, "--warmup", "1", "--steps", "2", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    printed = json.loads(captured.out)
    rows = {(r["strategy"], r["replicas"]): r for r in printed["results"] if r["device_kind"] == "cpu"}
    assert set(rows) == {("plain", 1), ("sharded", 2), ("sharded", 3), ("multi_worker", 2), ("multi_worker", 3)}
    for key, row in rows.items():
        assert row["status"] == "ok", (key, row["reason"])
        # The largest process's peak over what it held before the model: the model's state at least (the MLP's
        # parameters, gradients and SGD state are sharded 2 or 3 ways, or whole).
        assert row["peak_memory_bytes"] > 0 and row["samples_per_s"] > 0, key
    assert "peak_memory_bytes" in printed["definitions"]
    png = (tmp_path / "stratagem-bench.png").read_bytes()
    assert len(png) > 10_000


def test_a_peak_that_cannot_be_reset_is_reported_unknown_not_an_earlier_peak(monkeypatch):
    from stratagem.bench import peak_memory

    monkeypatch.setattr(peak_memory, "_reset_peak_rss", lambda: False)
    assert peak_memory.PeakMemory.start("cpu").peak() is None
    monkeypatch.setattr(peak_memory, "_reset_peak_rss", lambda: True)
    assert peak_memory.PeakMemory.start("cpu").peak() is not None
