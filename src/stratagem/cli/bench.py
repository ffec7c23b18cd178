"""``stratagem bench``: how the strategies scale on this machine, against plain PyTorch, in one run.

Measures samples/s of the reference workloads (the MLP and CNN of the peer benchmarks) for each
strategy and replica count (1, 2, ... up to the logical CPU devices, and the GPUs when there are
any), prints a table with the ratio to plain PyTorch and the scaling efficiency, and writes a PNG
plot and a JSON file. A configuration that cannot run here or fails is listed with the reason.
A warning says when the figures are not to be trusted (`stratagem.bench.trust`): the machine was
busy when the run began, a configuration's runs disagree, or an efficiency is above what the
hardware allows.

Exit code: 0 when every configuration ran or cannot run on this machine (said why), 1 when one
that should run failed or timed out, 2 for bad options.

    $ stratagem bench --quick                      # MLP only, 10 + 50 steps: under a minute on 2 cores
    $ stratagem bench --workloads cnn --strategies mirrored,multi_worker --replicas 1,2
    $ stratagem bench --out results/ --json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from stratagem.bench.registry import BENCH_STRATEGIES
from stratagem.bench.scaling import (
    DEFINITIONS,
    PLAIN,
    ScalingConfig,
    ScalingReport,
    ScalingRow,
    run_scaling,
)
from stratagem.bench.trust import EFFICIENCY_LIMIT
from stratagem.bench.workloads import WORKLOADS
from stratagem.cli.checks import check_writable_directory
from stratagem.errors import InputError, StratagemError

if TYPE_CHECKING:
    from rich.console import JustifyMethod

JSON_NAME = "stratagem-bench.json"
PLOT_NAME = "stratagem-bench.png"
_DEFAULTS = ScalingConfig()
_QUICK = ScalingConfig.quick()


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench",
        help="measure how the strategies scale on this machine against plain PyTorch",
        description="Samples/s of the MLP and CNN reference workloads for each strategy and replica count "
        "(logical CPU devices, and GPUs when present) against plain PyTorch in one process, all in "
        "one run. Prints a table with the ratio to plain and the scaling efficiency (speedup over one "
        "replica / ideal speedup: N for GPUs, 1 for logical CPUs, which share the cores) and writes a "
        "PNG plot and a JSON file. Warns when the figures are not to be trusted: a busy machine (load "
        "average against the cores), runs of one configuration that disagree, or an efficiency above "
        "what the hardware allows.",
    )
    parser.add_argument(
        "--workloads",
        type=_names,
        metavar="NAMES",
        help=f"comma-separated, from {','.join(WORKLOADS)} (default: all; --quick: mlp)",
    )
    parser.add_argument(
        "--strategies",
        type=_names,
        metavar="NAMES",
        help=f"comma-separated, from {','.join(BENCH_STRATEGIES)} (default: all; plain PyTorch "
        "always runs as the baseline)",
    )
    parser.add_argument(
        "--replicas",
        type=_counts,
        metavar="COUNTS",
        help="comma-separated replica counts, e.g. 1,2 (default: 1, 2, 4, ... up to the devices of each kind)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a short run: workloads {','.join(_QUICK.workloads)}, {_QUICK.warmup} warm-up + "
        f"{_QUICK.steps} timed steps, one round (options given explicitly still apply)",
    )
    parser.add_argument(
        "--steps",
        type=_whole,
        metavar="N",
        help=f"timed steps per configuration (default: {_DEFAULTS.steps}; --quick: {_QUICK.steps})",
    )
    parser.add_argument(
        "--warmup",
        type=_whole,
        metavar="N",
        help=f"untimed steps first (default: {_DEFAULTS.warmup}; --quick: {_QUICK.warmup})",
    )
    parser.add_argument(
        "--rounds",
        type=_whole,
        metavar="N",
        help=f"measure everything N times and report medians (default: {_DEFAULTS.rounds})",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="seconds one configuration may take before it is stopped and reported as failed "
        f"(default: {_DEFAULTS.timeout_s:g}; --quick: {_QUICK.timeout_s:g})",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("."),
        metavar="DIR",
        help=f"directory for {JSON_NAME} and {PLOT_NAME} (default: the current directory; created if missing)",
    )
    parser.add_argument("--plot", type=Path, metavar="PATH", help=f"PNG path (default: DIR/{PLOT_NAME})")
    parser.add_argument("--save-json", type=Path, metavar="PATH", help=f"JSON path (default: DIR/{JSON_NAME})")
    parser.add_argument(
        "--json", action="store_true", help="print the results as JSON instead of the table (the files are written too)"
    )
    return parser


PLOT_EXTRA = "pip install 'stratagem[bench]' (or pip install matplotlib)"
"""How to get matplotlib, which draws the plot (not in the main job's set, `scripts/venv.sh train`)."""


def run(args: argparse.Namespace) -> int:
    try:
        config = _config(args)
        json_path, plot_path = _output_paths(args)
        can_plot = _check_plotting(args)
    except StratagemError as error:
        print(f"stratagem bench: {error}", file=sys.stderr)
        return 2
    console = Console(highlight=False, soft_wrap=True)
    if not console.is_terminal:
        # Piped to a file: rich would assume 80 columns and squeeze the table; the reasons need room.
        console = Console(highlight=False, soft_wrap=True, width=200)
    progress = Console(stderr=True, highlight=False, soft_wrap=True)
    if not args.json:
        console.print(Text(_describe(config, quick=args.quick), style="bold"))
    try:
        report = run_scaling(config, progress=lambda line: progress.print(Text(line, style="dim")))
    except StratagemError as error:  # a replica count this machine cannot hold: bad input, found before any work
        print(f"stratagem bench: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the measuring processes share the terminal's Ctrl-C and stop with it
        print("stratagem bench: interrupted; nothing written.", file=sys.stderr)
        return 130
    files = {"json": str(json_path), "plot": str(plot_path) if can_plot else None}
    result = {**report.to_dict(), "files": files}
    try:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        if can_plot:
            # Import here: matplotlib takes a while to load and only this command needs it.
            from stratagem.bench.plot import write_plot

            write_plot(report, plot_path)
    except OSError as error:  # the disk filled, or the directory went away during the measurement
        print(f"stratagem bench: could not write the results: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
        for warning in report.warnings:  # also in the JSON ("warnings"); said where a person reads it too
            print(f"stratagem bench: warning: {warning}", file=sys.stderr)
    else:
        console.print(_table(report))
        if report.machine.no_gpu_reason:
            console.print(Text(f"No GPU rows: {report.machine.no_gpu_reason}", style="yellow"))
        for name in ("ratio_vs_plain", "scaling_efficiency", "ideal_speedup", "peak_memory_bytes"):
            console.print(Text(f"{name}: {DEFINITIONS[name]}", style="dim"))
        for warning in report.warnings:
            console.print(Text(f"Warning: {warning}", style="bold yellow"))
        written = f"{json_path} and {plot_path}" if can_plot else f"{json_path} (no plot: matplotlib is not installed)"
        console.print(f"wrote {written} ({report.elapsed_s:.0f} s)")
    if report.failed:
        print(
            f"stratagem bench: {len(report.failed)} configuration(s) failed: "
            + "; ".join(f"{row.workload} {row.label} ({row.kind}): {row.reason}" for row in report.failed),
            file=sys.stderr,
        )
        return 1
    return 0


def _config(args: argparse.Namespace) -> ScalingConfig:
    given: dict[str, Any] = {
        key: value
        for key, value in (
            ("workloads", args.workloads),
            ("strategies", args.strategies),
            ("replicas", args.replicas),
            ("steps", args.steps),
            ("warmup", args.warmup),
            ("rounds", args.rounds),
            ("timeout_s", args.timeout),
        )
        if value is not None
    }
    return ScalingConfig.quick(**given) if args.quick else ScalingConfig(**given)


def _check_plotting(args: argparse.Namespace) -> bool:
    """Whether the plot can be drawn (matplotlib is installed), said before the measurement: without it the table and
    the JSON are still written, unless --plot asked for the plot by name."""
    if importlib.util.find_spec("matplotlib") is not None:
        return True
    if args.plot is not None:
        raise InputError(
            f"--plot needs matplotlib, which is not installed. Received: --plot {args.plot}. Install it with "
            f"{PLOT_EXTRA}, or leave --plot out for the table and the JSON alone."
        )
    print(
        f"stratagem bench: matplotlib is not installed, so no {PLOT_NAME} will be drawn (the table and the JSON are); "
        f"for the plot: {PLOT_EXTRA}",
        file=sys.stderr,
        flush=True,
    )
    return False


def _output_paths(args: argparse.Namespace) -> tuple[Path, Path]:
    """The JSON and PNG paths, checked writable before the (long) measurement starts."""
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise InputError(
            f"--out must be a directory. Received: --out {out}, which is a file. "
            "Name a directory (it is created if missing)."
        )
    json_path = args.save_json or out / JSON_NAME
    plot_path = args.plot or out / PLOT_NAME
    if args.save_json is None or args.plot is None:
        check_writable_directory(out, "--out")  # before the (long) measurement: /proc/x fails here, not after it
        out.mkdir(parents=True, exist_ok=True)
    for flag, path in (("--save-json", json_path), ("--plot", plot_path)):
        if path.is_dir():
            raise InputError(
                f"{flag} must be a file path. Received: {flag} {path}, which is a directory. "
                f"Use e.g. {path / (JSON_NAME if flag == '--save-json' else PLOT_NAME)}."
            )
        parent = path.parent
        if not parent.is_dir():
            raise InputError(
                f"{flag}: cannot write into {parent} (missing). Received: {flag} {path}. "
                "Create the directory or choose another path."
            )
        check_writable_directory(parent, flag)
    return json_path, plot_path


def _describe(config: ScalingConfig, *, quick: bool) -> str:
    replicas = ",".join(map(str, config.replicas)) if config.replicas else "1..devices"
    trimmed = " (--quick)" if quick else ""
    return (
        f"stratagem bench{trimmed}: workloads {','.join(config.workloads)}; strategies "
        f"{','.join(config.strategies)}; replicas {replicas}; {config.warmup} warm-up + {config.steps} timed "
        f"steps, {config.rounds} round(s); each configuration in fresh processes, plain PyTorch first and last"
    )


def _table(report: ScalingReport) -> Table:
    table = Table(title="stratagem bench: samples/s against plain PyTorch (one process)")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("workload", "left"),
        ("device", "left"),
        ("strategy", "left"),
        ("replicas", "right"),
        ("samples/s", "right"),
        ("peak MiB", "right"),
        ("x plain", "right"),
        ("speedup", "right"),
        ("efficiency", "right"),
        ("final loss", "right"),
    )
    for column, justify in columns:
        table.add_column(column, justify=justify, no_wrap=True)
    table.add_column("status", overflow="fold")  # reasons can be long: they wrap, the figures never do
    for row in report.rows:
        table.add_row(
            row.workload,
            row.kind,
            row.strategy,
            str(row.replicas),
            _number(row.samples_per_s, ",.0f"),
            _number(None if row.peak_memory_bytes is None else row.peak_memory_bytes / 2**20, ",.0f"),
            _number(row.ratio_vs_plain, ".3f"),
            _number(row.speedup, ".2f"),
            _efficiency(row),
            _number(row.final_loss, ".5f"),
            _status(row),
            style="dim" if row.status == "unavailable" else None,
            end_section=row is _last_of_group(report.rows, row),
        )
    return table


def _efficiency(row: ScalingRow) -> Text:
    """The efficiency, flagged where it is above what the hardware allows (the warnings say why)."""
    text = _number(row.scaling_efficiency, ".2f")
    if row.scaling_efficiency is not None and row.scaling_efficiency > EFFICIENCY_LIMIT:
        return Text(f"{text} (!)", style="bold yellow")
    return Text(text)


def _status(row: ScalingRow) -> Text:
    if row.status == "ok":
        return Text("baseline" if row.strategy == PLAIN else "ok")
    style = "red" if row.status == "failed" else "yellow"
    return Text(f"{row.status}: {row.reason}", style=style)


def _last_of_group(rows: list[ScalingRow], row: ScalingRow) -> ScalingRow | None:
    group = [r for r in rows if (r.workload, r.kind) == (row.workload, row.kind)]
    return group[-1] if group else None


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names. Received: {text!r}. Use e.g. mlp,cnn.")
    return names


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"replica counts must be whole numbers separated by commas. Received: {text!r}. Use e.g. 1,2."
        ) from None
    if any(count < 1 for count in counts):
        raise argparse.ArgumentTypeError(
            f"replica counts must be positive (each is a number of replicas). Received: {text!r}. Use e.g. 1,2."
        )
    return counts


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number. Received: {text!r}.") from None
