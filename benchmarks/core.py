"""Issue 2's benchmark: plain PyTorch vs stratagem OneDevice and Mirrored (1 and 2 logical CPU replicas).

    .venv/bin/python benchmarks/core.py                 # both workloads, 3 rounds, 20 warm-up + 200 steps
    .venv/bin/python benchmarks/core.py --rounds 1 --steps 50 --workloads mlp

Prints a Markdown table of samples/s and ratios to plain PyTorch (same run), and writes JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from stratagem.bench.suite import Config, render_markdown, run_suite, suite_parser

CONFIGS = [
    Config("one_device", ("one_device",)),
    Config("mirrored x1", ("mirrored", "--replicas", "1")),
    Config("mirrored x2", ("mirrored", "--replicas", "2")),
]


def main() -> int:
    args = suite_parser(__doc__, Path("bench-results/core.json")).parse_args()
    rows = run_suite(CONFIGS, args.workloads.split(","), rounds=args.rounds, warmup=args.warmup, steps=args.steps,
                     progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(render_markdown(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([r.to_dict() for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
