"""``stratagem trace``: read the trace a job wrote (`stratagem launch --trace DIR`, `strategy.trace(DIR)`).

stratagem trace summary traces/            # per step and worker: input, compute, waits, transfer, idle
                                           # (a parameter-server job: each worker's functions, each server's updates)
stratagem trace summary traces/ --json     # the same report as JSON
stratagem trace merge traces/              # traces/trace.json.gz, for Perfetto or chrome://tracing
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stratagem.errors import InputError
from stratagem.trace.merge import load, merge
from stratagem.trace.summary import TraceSummary
from stratagem.trace.summary import report as trace_report


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "trace",
        help="summarize or merge the per-worker trace files of a job",
        description="Read the files each worker wrote in DIR (worker-<rank>.json) under --trace DIR.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    summary = actions.add_parser(
        "summary",
        help="where each step's time went per worker, and the late worker",
        description=(
            "Per step and worker: input, compute, waiting for peers, transfer and idle (they add up to the step), "
            "the late worker named by its arrival at the collectives, and a PNG of the breakdown."
        ),
    )
    summary.add_argument("directory", metavar="DIR", help="the directory given to --trace")
    summary.add_argument("--json", action="store_true", help="print the report as JSON")
    summary.add_argument(
        "--png", metavar="PATH", help="where to write the breakdown's plot (default DIR/breakdown.png); 'none': no plot"
    )
    merged = actions.add_parser(
        "merge", help="merge the worker files into one Chrome trace-event file (Perfetto, chrome://tracing)"
    )
    merged.add_argument("directory", metavar="DIR", help="the directory given to --trace")
    merged.add_argument("-o", "--output", metavar="PATH", help="the merged file (default DIR/trace.json.gz)")
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "merge":
            path = merge(args.directory, args.output)
            print(f"wrote {path}: open it at https://ui.perfetto.dev or chrome://tracing")
            return 0
        report = trace_report(load(args.directory))
    except InputError as error:
        print(f"stratagem trace {args.action}: error: {error}", file=sys.stderr)
        return 2
    png = None
    if args.png != "none" and isinstance(report, TraceSummary) and report.rows:
        png = report.plot(Path(args.directory) / "breakdown.png" if args.png is None else args.png)
    if args.json:
        print(json.dumps({**report.to_dict(), "png": None if png is None else str(png)}, indent=2))
    else:
        print(report.text())
        if png is not None:
            print(f"plot: {png}")
    return 0
