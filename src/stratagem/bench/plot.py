"""The PNG of a `stratagem bench` run: samples/s, scaling efficiency and memory per rank against replica count.

One column per workload. Top: samples/s of each strategy and device kind against its replica
count, plain PyTorch as a dashed horizontal line. Middle: scaling efficiency (1.0 = nothing lost).
Bottom: peak memory per rank (the largest worker process's, or GPU's) against the worker count, plain
PyTorch dashed: a sharded rank's falls with N, a replica's does not.
Configurations that were not measured are listed under the figure with their status.

Example:
    >>> write_plot(report, "stratagem-bench.png")   # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

from stratagem.bench.scaling import PLAIN, ScalingReport


def write_plot(report: ScalingReport, path: str | Path) -> Path:
    """Draws the report with matplotlib's Agg canvas (no display needed) and saves it as a PNG at `path`."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    workloads = list(dict.fromkeys(row.workload for row in report.rows))
    # A Figure on the Agg canvas, not pyplot: no window, no global backend switch in the caller's program.
    figure = Figure(figsize=(6 * len(workloads), 12))
    FigureCanvasAgg(figure)
    axes = figure.subplots(3, len(workloads), squeeze=False)
    cycle = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for column, workload in enumerate(workloads):
        top, bottom, memory = axes[0][column], axes[1][column], axes[2][column]
        rows = [row for row in report.rows if row.workload == workload]
        series = list(dict.fromkeys((row.strategy, row.kind) for row in rows if row.strategy != PLAIN))
        for index, (strategy, kind) in enumerate(series):
            color = cycle[index % len(cycle)]
            measured = [r for r in rows if (r.strategy, r.kind) == (strategy, kind) and r.samples_per_s is not None]
            if not measured:
                continue
            label = f"{strategy} ({kind})"
            top.plot(
                [r.replicas for r in measured], [r.samples_per_s for r in measured], "o-", color=color, label=label
            )
            efficient = [r for r in measured if r.scaling_efficiency is not None]
            bottom.plot(
                [r.replicas for r in efficient],
                [r.scaling_efficiency for r in efficient],
                "o-",
                color=color,
                label=label,
            )
            held = [(r.replicas, r.peak_memory_bytes / 2**20) for r in measured if r.peak_memory_bytes is not None]
            memory.plot([n for n, _ in held], [mib for _, mib in held], "o-", color=color, label=label)
        for row in rows:
            if row.strategy == PLAIN and row.samples_per_s is not None:
                top.axhline(
                    row.samples_per_s,
                    linestyle="--",
                    color="black" if row.kind == "cpu" else "grey",
                    label=f"plain PyTorch ({row.kind})",
                )
            if row.strategy == PLAIN and row.peak_memory_bytes is not None:
                memory.axhline(
                    row.peak_memory_bytes / 2**20,
                    linestyle="--",
                    color="black" if row.kind == "cpu" else "grey",
                    label=f"plain PyTorch ({row.kind})",
                )
        bottom.axhline(1.0, linestyle=":", color="black", linewidth=1)
        replica_counts = sorted({row.replicas for row in rows})
        top.set(title=f"{workload}: samples/s", xlabel="replicas", ylabel="samples/s", xticks=replica_counts)
        bottom.set(
            title=f"{workload}: scaling efficiency", xlabel="replicas", ylabel="efficiency", xticks=replica_counts
        )
        memory.set(
            title=f"{workload}: peak memory per rank", xlabel="replicas (workers)", ylabel="MiB over the baseline",
            xticks=replica_counts,
        )  # fmt: skip
        top.set_ylim(bottom=0)
        bottom.set_ylim(bottom=0)
        memory.set_ylim(bottom=0)
        for axis in (top, bottom, memory):
            axis.grid(alpha=0.3)
            if axis.get_legend_handles_labels()[0]:
                axis.legend(fontsize="small")
    missing = [
        f"{row.workload} {row.label} ({row.kind}): {row.status}" for row in report.rows if row.samples_per_s is None
    ]
    if missing:
        figure.text(0.01, 0.005, "not measured: " + "; ".join(missing), fontsize="x-small", wrap=True, va="bottom")
    figure.suptitle(
        "stratagem bench: throughput, scaling and memory per rank per strategy\n"
        "efficiency = speedup over 1 replica / ideal speedup (N for GPUs, 1 for logical CPUs)",
        fontsize="medium",
    )
    figure.tight_layout(rect=(0, 0.04 if missing else 0, 1, 0.94))
    path = Path(path)
    figure.savefig(path, format="png", dpi=100)
    return path
