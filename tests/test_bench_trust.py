"""`stratagem bench` says when its figures are not to be trusted: a busy machine, runs that disagree,
an efficiency above what the hardware allows (figures worked by hand)."""

from __future__ import annotations

from rich.console import Console

from stratagem.bench.registry import BenchMachine
from stratagem.bench.scaling import ScalingConfig, ScalingReport, ScalingRow
from stratagem.bench.trust import Load, machine_load, trust_warnings
from stratagem.cli.bench import _table


def _rows(plain_runs, two_replicas_efficiency):
    return [
        ScalingRow(
            workload="mlp",
            strategy="plain",
            kind="cpu",
            replicas=1,
            devices=["cpu"],
            status="ok",
            samples_per_s_runs=plain_runs,
            ratios_runs=[1.0],
        ),
        ScalingRow(
            workload="mlp",
            strategy="mirrored",
            kind="cpu",
            replicas=1,
            devices=["cpu:0"],
            status="ok",
            samples_per_s_runs=[105.0],
            ratios_runs=[0.1],
            speedup=1.0,
            ideal_speedup=1,
            scaling_efficiency=1.0,
        ),
        ScalingRow(
            workload="mlp",
            strategy="mirrored",
            kind="cpu",
            replicas=2,
            devices=["cpu:0", "cpu:1"],
            status="ok",
            samples_per_s_runs=[527.0],
            ratios_runs=[9.37],
            speedup=two_replicas_efficiency,
            ideal_speedup=1,
            scaling_efficiency=two_replicas_efficiency,
        ),
    ]


def test_an_idle_machine_with_steady_runs_and_possible_efficiencies_gives_no_warning():
    assert trust_warnings(_rows([1000.0, 1100.0], 0.95), Load(one_minute=0.4, cores=2)) == []
    assert trust_warnings(_rows([1000.0, 1100.0], 1.05), None) == []  # within timing noise


def test_a_busy_machine_is_named_with_its_load_against_its_cores():
    (warning,) = trust_warnings(_rows([1000.0, 1100.0], 0.95), Load(one_minute=3.52, cores=2))
    assert warning.startswith("The machine was busy before the run: load average 3.52 on 2 core(s)")
    assert "not to be trusted" in warning


def test_runs_that_disagree_and_an_impossible_efficiency_are_each_named():
    # Plain ran 1,000 then 600 samples/s: (1000 - 600) / median 800 = 50%.
    warnings = trust_warnings(_rows([1000.0, 600.0], 5.02), Load(one_minute=0.1, cores=2))
    assert len(warnings) == 2
    assert warnings[0].startswith("mlp plain (cpu): its runs differ by 50% (samples/s 1,000, 600)")
    assert warnings[1].startswith("mlp mirrored x2 (cpu): scaling efficiency 5.02 is above what the hardware allows")


def test_the_report_carries_the_warnings_and_the_table_flags_the_efficiency():
    rows = _rows([1000.0, 1100.0], 5.02)
    load = Load(one_minute=0.2, cores=2)
    report = ScalingReport(
        config=ScalingConfig(),
        machine=BenchMachine(cpu_devices=2),
        rows=rows,
        elapsed_s=1.0,
        load_before=load,
        warnings=trust_warnings(rows, load),
    )
    data = report.to_dict()
    assert data["trusted"] is False and len(data["warnings"]) == 1
    assert data["machine"]["load_average_1min"] == 0.2 and data["machine"]["cores"] == 2
    console = Console(width=250, record=True)
    console.print(_table(report))
    assert any("mirrored" in line and "5.02 (!)" in line for line in console.export_text().splitlines())
    load_now = machine_load()
    assert load_now is None or (load_now.one_minute >= 0 and load_now.cores >= 1)
