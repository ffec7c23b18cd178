"""How the strategies scale on this machine: samples/s of the reference workloads for each strategy
and replica count, against plain PyTorch in one process, all in one run (`stratagem bench`).

Every configuration is measured in freshly spawned processes (`stratagem.bench.measure`), one per
replica for strategies whose replicas are processes. Within each round plain PyTorch runs first
and last and each ratio is taken against the mean of those two runs, so slow drift of a shared
machine affects both sides alike. A configuration that cannot run here, or fails, or outlives its
timeout, stays in the results with the reason.

Figures (also in `DEFINITIONS`, which the JSON carries):

- ratio vs plain = samples/s / samples/s of plain PyTorch on one device of the same kind
  (the whole CPU with all its threads, or one GPU), per round; the median is reported.
- speedup = samples/s with N replicas / samples/s with 1 replica of the same strategy and kind.
- ideal speedup = how many times more hardware N replicas have than one: N for GPUs, 1 for
  logical CPU devices (they share the same cores, which one replica already keeps busy).
- scaling efficiency = speedup / ideal speedup (1.0: nothing lost to distribution).

Example:
    >>> report = run_scaling(ScalingConfig.quick(), progress=print)   # doctest: +SKIP
    >>> report.to_dict()["results"][0]["samples_per_s"]                 # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.multiprocessing as mp

from stratagem.bench.measure import MeasureRequest, error_file, measure_rank
from stratagem.bench.multi_process import spawn_ranks
from stratagem.bench.registry import (
    BENCH_STRATEGIES,
    MIN_CPU_WORKERS,
    BenchMachine,
    process_device,
    replica_devices,
)
from stratagem.bench.trust import Load, machine_load, trust_warnings
from stratagem.bench.workloads import WORKLOADS
from stratagem.cluster.launch import free_ports
from stratagem.errors import InputError
from stratagem.timeouts import check_seconds

PLAIN = "plain"

DEFINITIONS = {
    "samples_per_s": "global examples trained per second over the timed steps (median over rounds)",
    "ratio_vs_plain": "samples/s / samples/s of plain PyTorch in one process on one device of the same kind "
    "(all CPU threads, or one GPU), taken per round against that round's plain runs; median",
    "speedup": "samples/s with N replicas / samples/s with 1 replica of the same strategy and device kind",
    "ideal_speedup": "how many times more hardware N replicas have than one: N for GPUs, 1 for logical CPU "
    "devices (they share the cores one replica already keeps busy)",
    "scaling_efficiency": "speedup / ideal_speedup (1.0: distribution loses nothing)",
    "peak_memory_bytes": "the largest process's peak resident set over its resident set before the model was built "
    "(VmHWM - VmRSS; an in-process strategy's replicas all count in its one process), on GPUs the largest "
    "device's peak allocated memory; the largest over rounds",
}


@dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    """What `run_scaling` measures and for how long.

    Example:
        >>> ScalingConfig(workloads=("mlp",), strategies=("mirrored",), replicas=(1, 2), steps=50).rounds
        1
    """

    workloads: tuple[str, ...] = ("mlp", "cnn")
    """Reference workloads (`stratagem.bench.workloads.WORKLOADS`)."""
    strategies: tuple[str, ...] = tuple(BENCH_STRATEGIES)
    """Strategies to measure (`stratagem.bench.registry.BENCH_STRATEGIES`); plain PyTorch always runs."""
    replicas: tuple[int, ...] | None = None
    """Replica counts; None: 1, 2, 4, ... up to each device kind's count, and that count."""
    warmup: int = 20
    """Untimed steps before the clock starts."""
    steps: int = 100
    """Timed steps per configuration."""
    rounds: int = 1
    """Times every configuration is measured; figures are medians over rounds."""
    timeout_s: float = 300.0
    """Seconds one configuration may take from process start to result; longer and it is stopped. Each
    wait inside it (for another replica or rank) gives up after half of this, naming who was missing."""

    @classmethod
    def quick(cls, **overrides: Any) -> ScalingConfig:
        """The `--quick` preset: the MLP only, 10 warm-up and 50 timed steps, one round."""
        return cls(**{"workloads": ("mlp",), "warmup": 10, "steps": 50, "timeout_s": 120.0, **overrides})

    def __post_init__(self) -> None:
        _check_names("workloads", self.workloads, WORKLOADS)
        _check_names("strategies", self.strategies, BENCH_STRATEGIES)
        if self.replicas is not None:
            if not self.replicas or any(not _is_int(n) or n < 1 for n in self.replicas):
                raise InputError(
                    f"replicas must be positive whole numbers. Received: replicas={self.replicas!r}. "
                    "Use e.g. replicas=(1, 2)."
                )
            if len(set(self.replicas)) != len(self.replicas):
                raise InputError(
                    f"replicas lists a count twice. Received: replicas={self.replicas!r}. List each count once."
                )
        for name, value, least in (("warmup", self.warmup, 0), ("steps", self.steps, 1), ("rounds", self.rounds, 1)):
            if not _is_int(value) or value < least:
                raise InputError(f"{name} must be a whole number >= {least}. Received: {name}={value!r}.")
        check_seconds("timeout_s", self.timeout_s)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(kw_only=True)
class ScalingRow:
    """One configuration: plain PyTorch, or a strategy with N replicas of one device kind."""

    workload: str
    strategy: str
    """A strategy name, or "plain" for the baseline."""
    kind: str
    """"cpu" (logical CPU devices) or "gpu"."""
    replicas: int
    devices: list[str]
    status: str = "pending"
    """"ok" (measured), "failed" (ran and failed or timed out) or "unavailable" (cannot run here)."""
    reason: str | None = None
    samples_per_s_runs: list[float] = field(default_factory=list)
    ratios_runs: list[float] = field(default_factory=list)
    final_loss: float | None = None
    peak_memory_runs: list[int] = field(default_factory=list)
    speedup: float | None = None
    ideal_speedup: int | None = None
    scaling_efficiency: float | None = None

    @property
    def samples_per_s(self) -> float | None:
        return statistics.median(self.samples_per_s_runs) if self.status == "ok" and self.samples_per_s_runs else None

    @property
    def ratio_vs_plain(self) -> float | None:
        return statistics.median(self.ratios_runs) if self.status == "ok" and self.ratios_runs else None

    @property
    def peak_memory_bytes(self) -> int | None:
        """Peak memory of one process (or GPU) over its baseline: the largest over rounds."""
        return max(self.peak_memory_runs) if self.status == "ok" and self.peak_memory_runs else None

    @property
    def label(self) -> str:
        return PLAIN if self.strategy == PLAIN else f"{self.strategy} x{self.replicas}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "strategy": self.strategy,
            "device_kind": self.kind,
            "replicas": self.replicas,
            "devices": self.devices,
            "status": self.status,
            "reason": self.reason,
            "samples_per_s": self.samples_per_s,
            "samples_per_s_runs": self.samples_per_s_runs,
            "ratio_vs_plain": self.ratio_vs_plain,
            "ratios_vs_plain_runs": self.ratios_runs,
            "speedup": self.speedup,
            "ideal_speedup": self.ideal_speedup,
            "scaling_efficiency": self.scaling_efficiency,
            "final_loss": self.final_loss,
            "peak_memory_bytes": self.peak_memory_bytes,
            "peak_memory_runs": self.peak_memory_runs,
        }


@dataclass(kw_only=True)
class ScalingReport:
    """Everything one `run_scaling` measured, with a JSON rendering (`to_dict`)."""

    config: ScalingConfig
    machine: BenchMachine
    rows: list[ScalingRow]
    elapsed_s: float
    load_before: Load | None = None
    """The machine's load average when the run started (None where the platform has none)."""
    warnings: list[str] = field(default_factory=list)
    """Why the figures are not to be trusted (a busy machine, unstable runs, an impossible efficiency)."""

    @property
    def failed(self) -> list[ScalingRow]:
        """Configurations that ran and failed (not those that cannot run on this machine)."""
        return [row for row in self.rows if row.status == "failed"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "machine": {
                **self.machine.to_dict(),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                **(self.load_before.to_dict() if self.load_before is not None else {}),
            },
            "definitions": DEFINITIONS,
            "trusted": not self.warnings,
            "warnings": list(self.warnings),
            "results": [row.to_dict() for row in self.rows],
            "elapsed_s": self.elapsed_s,
        }


def ratio_to_plain(samples_per_s: float, plain_runs: Sequence[float]) -> float:
    """samples/s over the mean of the plain PyTorch runs of the same round.

    Example:
        >>> ratio_to_plain(900.0, [1000.0, 800.0])
        1.0
    """
    return samples_per_s / statistics.fmean(plain_runs)


def ideal_speedup(kind: str, replicas: int) -> int:
    """N GPUs have N times the hardware of one; N logical CPU devices share one CPU's cores."""
    return replicas if kind == "gpu" else 1


def scaling_figures(
    samples_per_s: float, one_replica_samples_per_s: float, kind: str, replicas: int
) -> tuple[float, int, float]:
    """(speedup, ideal speedup, scaling efficiency) of N replicas against 1 of the same strategy.

    Example:
        >>> scaling_figures(3000.0, 1000.0, "gpu", 4)
        (3.0, 4, 0.75)
    """
    speedup = samples_per_s / one_replica_samples_per_s
    ideal = ideal_speedup(kind, replicas)
    return speedup, ideal, speedup / ideal


def default_replica_counts(available: int) -> list[int]:
    """1, 2, 4, ... below `available`, then `available` itself (2 -> [1, 2]; 6 -> [1, 2, 4, 6])."""
    counts, n = [], 1
    while n < available:
        counts.append(n)
        n *= 2
    return counts + [available] if available > 0 else []


def replica_counts(config: ScalingConfig, machine: BenchMachine, kind: str, strategy: str) -> list[int]:
    """The replica counts `strategy` is measured at on `kind`: the configured ones, else 1, 2, 4, ... up to the
    devices of that kind, with 1, 2 and 3 workers for a strategy of processes on the CPU.

    Example:
        >>> replica_counts(ScalingConfig(), BenchMachine(cpu_devices=2), "cpu", "sharded")
        [1, 2, 3]
    """
    if config.replicas:
        return sorted(config.replicas)
    counts = default_replica_counts(machine.max_replicas(kind))
    if kind == "cpu" and BENCH_STRATEGIES[strategy].one_process_per_replica:
        counts = sorted(set(counts) | set(range(1, MIN_CPU_WORKERS + 1)))
    return counts


def plan_rows(config: ScalingConfig, machine: BenchMachine) -> list[ScalingRow]:
    """Every row the run will report, in table order; those that cannot run here already say why.

    Raises InputError, before anything runs, for a replica count no device kind of this machine has (worker
    processes on the CPU share its cores, as threads do, and are not bounded by its logical devices).
    """
    most = max(machine.max_replicas(kind) for kind in machine.device_kinds())
    workers = any(BENCH_STRATEGIES[name].one_process_per_replica for name in config.strategies) and machine.gloo
    if workers:
        most = max(most, MIN_CPU_WORKERS)
    if config.replicas is not None and max(config.replicas) > most:
        raise InputError(
            f"replicas asks for more replicas than this machine has devices ({machine.cpu_devices} logical CPU "
            f"device(s), {machine.gpu_devices} GPU(s)"
            + (f"; worker processes on the CPU: up to {most}" if workers else "")
            + f"). Received: replicas={config.replicas!r}. "
            f"Use counts up to {most}, or configure more logical CPU devices."
        )
    rows = []
    for workload in config.workloads:
        for kind in machine.device_kinds():
            plain_device = "cpu" if kind == "cpu" else "cuda:0"
            rows.append(ScalingRow(workload=workload, strategy=PLAIN, kind=kind, replicas=1, devices=[plain_device]))
            for name in config.strategies:
                spec = BENCH_STRATEGIES[name]
                for n in replica_counts(config, machine, kind, name):
                    devices = (
                        [process_device(kind, r) for r in range(n)]
                        if spec.one_process_per_replica
                        else replica_devices(kind, n)
                    )
                    row = ScalingRow(workload=workload, strategy=name, kind=kind, replicas=n, devices=devices)
                    reason = spec.unavailable_reason(kind, n, machine)
                    if reason is not None:
                        row.status, row.reason = "unavailable", reason
                    rows.append(row)
    return rows


def run_scaling(
    config: ScalingConfig, *, machine: BenchMachine | None = None, progress: Callable[[str], None] | None = None
) -> ScalingReport:
    """Measures every configuration of `config` on this machine and returns the report.

    `progress` receives one line per finished measurement (the CLI prints them on stderr).
    """
    machine = machine or BenchMachine.detect()
    rows = plan_rows(config, machine)
    load_before = machine_load()  # before any measuring process adds to it
    start_method = _start_method()
    started = time.perf_counter()
    say = progress or (lambda _: None)
    for workload in config.workloads:
        for kind in machine.device_kinds():
            group = [row for row in rows if row.workload == workload and row.kind == kind]
            plain, others = group[0], [row for row in group[1:] if row.status == "pending"]
            for round_index in range(config.rounds):
                plain_runs = []
                for row in [plain, *others, plain]:
                    if row.status in ("failed", "unavailable"):
                        continue
                    result = _measure_row(row, config, start_method)
                    say(
                        f"{workload} {kind} round {round_index + 1}/{config.rounds}: {row.label}: "
                        + (f"{row.samples_per_s_runs[-1]:,.0f} samples/s" if result else f"failed: {row.reason}")
                    )
                    if result and row is plain:
                        plain_runs.append(row.samples_per_s_runs[-1])
                for row in others:
                    if plain_runs and len(row.samples_per_s_runs) == round_index + 1:
                        row.ratios_runs.append(ratio_to_plain(row.samples_per_s_runs[-1], plain_runs))
                if plain_runs:
                    plain.ratios_runs.append(1.0)
            for row in group:
                if row.status == "pending":
                    row.status = "ok"
            _fill_scaling(group)
    return ScalingReport(
        config=config,
        machine=machine,
        rows=rows,
        elapsed_s=time.perf_counter() - started,
        load_before=load_before,
        warnings=trust_warnings(rows, load_before),
    )


def _fill_scaling(group: Sequence[ScalingRow]) -> None:
    for row in group:
        if row.strategy == PLAIN or row.samples_per_s is None:
            continue
        one = next((r for r in group if r.strategy == row.strategy and r.replicas == 1), None)
        if one is not None and one.samples_per_s is not None:
            row.speedup, row.ideal_speedup, row.scaling_efficiency = scaling_figures(
                row.samples_per_s, one.samples_per_s, row.kind, row.replicas
            )


def _start_method() -> str:
    """forkserver where the platform has it, else spawn.

    Forking each measurement from a server that has imported torch once (and torch._dynamo, which the
    first optimizer imports) saves several seconds per configuration; the server has run no torch
    operation, so a forked process starts as fresh as a spawned one (no thread pool, no allocations).
    """
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    # Takes effect when the server starts (the first measurement); a module that fails to import is skipped.
    mp.get_context("forkserver").set_forkserver_preload(["stratagem.bench.measure", "torch._dynamo"])
    return "forkserver"


def _measure_row(row: ScalingRow, config: ScalingConfig, start_method: str) -> bool:
    """Measures one configuration once; records the figure, or marks the row failed with the reason."""
    strategy = None if row.strategy == PLAIN else row.strategy
    request = MeasureRequest(
        strategy=strategy,
        kind=row.kind,
        replicas=row.replicas,
        workload=row.workload,
        warmup=config.warmup,
        steps=config.steps,
        timeout_s=config.timeout_s,
    )
    processes = strategy is not None and BENCH_STRATEGIES[strategy].one_process_per_replica
    world = row.replicas if processes else 1
    ports = free_ports(world) if processes else []  # one address per worker of the loopback cluster
    with tempfile.TemporaryDirectory(prefix="stratagem-bench-") as error_dir:
        started = time.monotonic()
        try:
            result = spawn_ranks(
                measure_rank, world, request, ports, error_dir, timeout=config.timeout_s, start_method=start_method
            )
        except RuntimeError as error:
            row.status, row.reason = (
                "failed",
                _failure_reason(error, error_dir, world, time.monotonic() - started, config.timeout_s),
            )
            return False
    row.samples_per_s_runs.append(result["samples_per_s"])
    row.final_loss = result["final_loss"]
    if result.get("peak_memory_bytes") is not None:
        row.peak_memory_runs.append(result["peak_memory_bytes"])
    return True


def _failure_reason(error: RuntimeError, error_dir: str, world: int, elapsed: float, timeout: float) -> str:
    reported = []
    for rank in range(world):
        path = error_file(error_dir, rank)
        if path.exists():
            who = f"rank {rank}: " if world > 1 else ""
            reported.append(who + path.read_text().strip())
    if reported:
        return "; ".join(reported)
    if elapsed >= timeout:
        return f"did not finish within timeout_s={timeout:g} s and was stopped ({error})"
    return str(error)


def _check_names(what: str, names: Sequence[str], known: dict[str, Any]) -> None:
    if isinstance(names, str) or not names:
        raise InputError(
            f"{what} must be a non-empty list of names. Received: {what}={names!r}. Use some of {sorted(known)}."
        )
    unknown = [name for name in names if name not in known]
    if unknown:
        raise InputError(f"Unknown {what}: {unknown}. Received: {what}={tuple(names)!r}. Use some of {sorted(known)}.")
    if len(set(names)) != len(names):
        raise InputError(f"{what} lists a name twice. Received: {what}={tuple(names)!r}. List each once.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
