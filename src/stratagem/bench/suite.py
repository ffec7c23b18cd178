"""Runs several throughput configurations in one go and expresses each as a ratio to plain PyTorch.

Every configuration runs in its own subprocess, in rounds; plain PyTorch runs at the start and
at the end of every round, and each ratio is taken against the mean of the plain runs of the
same round, so slow drift of a shared machine affects both sides alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Config:
    name: str
    argv: tuple[str, ...]
    """Arguments after `python -m stratagem.bench.throughput` (or a whole command when `command` is set)."""
    command: tuple[str, ...] | None = None


@dataclass
class Row:
    workload: str
    config: str
    samples_per_s: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    final_loss: float | None = None

    @property
    def median_ratio(self) -> float:
        return statistics.median(self.ratios) if self.ratios else float("nan")

    @property
    def median_samples_per_s(self) -> float:
        return statistics.median(self.samples_per_s) if self.samples_per_s else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "config": self.config,
            "samples_per_s": self.samples_per_s,
            "ratios_vs_plain": self.ratios,
            "median_ratio": self.median_ratio,
            "median_samples_per_s": self.median_samples_per_s,
            "final_loss": self.final_loss,
        }


def suite_parser(description: str, json_default: Path) -> argparse.ArgumentParser:
    """The options every round-based benchmark script takes: workloads, rounds, warm-up, steps, JSON path."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="mlp,cnn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", type=Path, default=json_default)
    return parser


def run_one(config: Config, workload: str, warmup: int, steps: int, timeout: float = 600) -> dict[str, Any]:
    argv = (
        list(config.command) if config.command else [sys.executable, "-m", "stratagem.bench.throughput", *config.argv]
    )
    argv += ["--workload", workload, "--warmup", str(warmup), "--steps", str(steps)]
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(
            f"benchmark {config.name} on {workload} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_suite(
    configs: Sequence[Config],
    workloads: Sequence[str],
    *,
    rounds: int,
    warmup: int,
    steps: int,
    progress: Callable[[str], None] = lambda _: None,
) -> list[Row]:
    plain = Config("plain", ("plain",))
    rows: dict[tuple[str, str], Row] = {}
    for workload in workloads:
        for config in [plain, *configs]:
            rows[(workload, config.name)] = Row(workload, config.name)
        for round_index in range(rounds):
            before = run_one(plain, workload, warmup, steps)
            results = []
            for config in configs:
                results.append((config, run_one(config, workload, warmup, steps)))
                progress(
                    f"{workload} round {round_index + 1}: {config.name} {results[-1][1]['samples_per_s']:.0f} samples/s"
                )
            after = run_one(plain, workload, warmup, steps)
            baseline = (before["samples_per_s"] + after["samples_per_s"]) / 2
            plain_row = rows[(workload, "plain")]
            plain_row.samples_per_s += [before["samples_per_s"], after["samples_per_s"]]
            plain_row.ratios.append(1.0)
            plain_row.final_loss = before["final_loss"]
            for config, result in results:
                row = rows[(workload, config.name)]
                row.samples_per_s.append(result["samples_per_s"])
                row.ratios.append(result["samples_per_s"] / baseline)
                row.final_loss = result["final_loss"]
    return list(rows.values())


def render_markdown(rows: Sequence[Row]) -> str:
    lines = [
        "| workload | config | samples/s (median) | ratio vs plain (median) | ratios per round | final loss |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratios = ", ".join(f"{r:.3f}" for r in row.ratios)
        loss = "" if row.final_loss is None else f"{row.final_loss:.5f}"
        lines.append(
            f"| {row.workload} | {row.config} | {row.median_samples_per_s:.0f} | {row.median_ratio:.3f} | {ratios} | {loss} |"
        )
    return "\n".join(lines)
