"""The digits job behind ``stratagem train``: train under a strategy, evaluate, report.

The strategy comes from `stratagem.strategies.by_name` (the same names and default devices as
``stratagem launch --strategy NAME``); this module only trains and reports.

Example:
    >>> config = TrainConfig(epochs=2)
    >>> strategy, decision = build_strategy(config.strategy, config.devices)
    >>> try:
    ...     report = train_digits(config, strategy, decision)
    ... finally:
    ...     strategy.close()
    >>> report.test.accuracy, report.samples_per_s
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from stratagem.data.resume import ShuffledBatches
from stratagem.demo.digits import build_digits_model, load_digits_data, make_loader
from stratagem.demo.threads import threads_of_one_replica
from stratagem.diagnose import PlacementDecision
from stratagem.errors import InputError
from stratagem.strategies import ModelParallelStrategy, ParameterServerStrategy, Strategy
from stratagem.strategies.by_name import STRATEGY_NAMES, explain_built
from stratagem.train.callback import Callback
from stratagem.train.fit import EpochLog, fit
from stratagem.train.fit_state import TrainingContext
from stratagem.train.loop import Evaluation, evaluate
from stratagem.train.tracing import FitTrace

TARGET_ACCURACY = 0.95
"""The test accuracy the default run must reach."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The settings of one digits training run; the defaults reach 95% test accuracy."""

    strategy: str = "mirrored"
    """One of `STRATEGY_NAMES`."""
    devices: tuple[str, ...] | None = None
    """Device names in TF or torch spelling; None lets `build_strategy` choose."""
    epochs: int = 10
    batch_size: int = 256
    """The GLOBAL batch, split among the replicas. 256 rather than 64: on a small conv net each replica's step is
    mostly fixed cost (every op runs once per replica whatever its slice), so at 64 (32 a replica) two CPU replicas
    ran 0.73x one device; at 256 0.97x, median of four interleaved pairs (benchmarks/digits_job.py, report
    benchmarks/reports/2026-12-07-cpu-2vcpu-digits-job.md)."""
    lr: float = 1e-2
    """Adam's learning rate (raised with the batch: 95.6% test accuracy after 5 epochs, 98.1% after 10)."""
    seed: int = 0
    """Seeds the model's initial weights and the shuffle order; same seed, same numbers."""
    precision: str = "32"
    """"32", "bf16" or "fp16" (GPUs only): `fit`'s precision setting."""
    trace: str | bool = True
    """`fit`'s trace setting: True, where a sample of the steps went, in memory (`TrainReport.trace`); a directory
    to trace every step into; False: no trace."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGY_NAMES:
            raise InputError(
                f"Unknown strategy. Received: strategy={self.strategy!r}. Choose one of {', '.join(STRATEGY_NAMES)}."
            )
        for name in ("epochs", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive integer. Received: {name}={value!r}.")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise InputError(f"lr must be a positive finite number. Received: lr={self.lr!r}. Try lr=0.003.")

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "devices": list(self.devices) if self.devices else None,
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "lr": self.lr,
            "seed": self.seed,
            "precision": self.precision,
            "trace": self.trace,
        }


@dataclass(frozen=True)
class TrainReport:
    """What a run did and where: per-epoch history, test metrics, throughput, placement."""

    config: TrainConfig
    devices: list[str]
    """The logical device of each replica, in replica order (of each stage, for model parallelism)."""
    device_decision: PlacementDecision
    explanation: dict[str, Any]
    """``strategy.explain().to_dict()``."""
    history: list[EpochLog]
    test: Evaluation
    train_time_s: float
    """Wall time of this run's training steps alone (no evaluation, no set-up; after a resume, none of the run
    that wrote the backup)."""
    elapsed_s: float
    """Wall time of this whole run: data, model, training and evaluation."""
    num_train_examples: int
    """Examples this run trained on (after a resume, not those the run that wrote the backup trained on)."""
    num_resumed_examples: int = 0
    """Examples trained on before the resume, which `history` counts and the throughput leaves out (0: a fresh run)."""
    trace: FitTrace | None = None
    """Where this worker's steps went, from the trace `fit` leaves on (None: `trace` was a directory or False, or
    the strategy does not sample its steps)."""

    @property
    def samples_per_s(self) -> float:
        """Training examples processed per second of training wall time."""
        return self.num_train_examples / self.train_time_s if self.train_time_s > 0 else 0.0

    @property
    def reached_target(self) -> bool:
        return self.test["accuracy"] >= TARGET_ACCURACY

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.explanation["strategy"],
            "devices": self.devices,
            "num_replicas_in_sync": self.explanation["num_replicas_in_sync"],
            "device_decision": self.device_decision.to_dict(),
            "config": self.config.to_dict(),
            "epochs": [
                {"epoch": e.epoch, "loss": e.metrics["loss"], "accuracy": e.metrics["accuracy"]} for e in self.history
            ],
            "test_loss": self.test["loss"],
            "test_accuracy": self.test["accuracy"],
            "num_test_examples": self.test.num_examples,
            "target_accuracy": TARGET_ACCURACY,
            "reached_target": self.reached_target,
            "num_train_examples": self.num_train_examples,
            "num_resumed_examples": self.num_resumed_examples,
            "train_time_s": self.train_time_s,
            "samples_per_s": self.samples_per_s,
            "elapsed_s": self.elapsed_s,
            "explanation": self.explanation,
            "trace": None if self.trace is None else self.trace.to_dict(),
        }


def train_digits(
    config: TrainConfig, strategy: Strategy, device_decision: PlacementDecision, *, callbacks: Sequence[Callback] = ()
) -> TrainReport:
    """Trains the digits conv net with Adam under ``strategy`` with `fit`, then evaluates it on the test split.

    ``callbacks`` go to `fit` (the CLI passes a progress bar, and a backup with ``--backup-dir``).
    """
    start = time.perf_counter()
    data = load_digits_data()
    net = build_digits_model(config.seed)
    # The order of each epoch depends only on (seed, epoch): the same run repeats exactly, and resumes exactly.
    train = ShuffledBatches((data.train_x, data.train_y), config.batch_size, seed=config.seed)
    before = _BeforeThisRun()
    # Between steps this thread runs only tiny ops; with more intra-op threads than a replica has, each woke an
    # OpenMP worker that then competed with the replicas for the cores (demo/threads.py, measured).
    with threads_of_one_replica(strategy):
        history = fit(
            strategy,
            net,
            torch.optim.Adam(net.parameters(), lr=config.lr),
            F.cross_entropy,
            train,
            epochs=config.epochs,
            metrics=["accuracy"],
            callbacks=[*callbacks, before],
            precision=config.precision,
            trace=config.trace,
        )
    test_loader = make_loader(data.test_x, data.test_y, config.batch_size, shuffle=False)
    test = evaluate(strategy, history.model, test_loader, F.cross_entropy, metrics=["accuracy"])
    explanation = explain_built(strategy, device_decision)
    return TrainReport(
        config=config,
        devices=_devices_used(strategy, explanation),
        device_decision=device_decision,
        explanation=explanation.to_dict(),
        history=history.epochs,
        test=test,
        train_time_s=sum(e.elapsed_s for e in history.epochs) - before.elapsed_s,
        elapsed_s=time.perf_counter() - start,
        num_train_examples=sum(e.num_examples for e in history.epochs) - before.num_examples,
        num_resumed_examples=before.num_examples,
        trace=history.trace,
    )


class _BeforeThisRun(Callback):
    """What a resumed run's history already holds when it begins (the epochs done, and the part of the epoch under
    way), so that the report's throughput is this run's: examples and step time of the run that wrote the backup
    are in `history` (the epoch logs go on from the backup's sums), not in this run's wall time."""

    def __init__(self) -> None:
        self.num_examples = 0
        self.elapsed_s = 0.0

    def on_train_begin(self, context: TrainingContext) -> None:
        # Backups restore before any other callback begins, so this reads the restored state (zeros when fresh).
        under_way = int(context.totals[1]) if context.totals.numel() > 1 else 0  # [loss sum, examples, ...]
        self.num_examples = sum(e.num_examples for e in context.history) + under_way
        self.elapsed_s = sum(e.elapsed_s for e in context.history) + context.epoch_elapsed_s


def _devices_used(strategy: Strategy, explanation: Any) -> list[str]:
    if isinstance(strategy, ModelParallelStrategy):  # one replica, spread over the stages' devices
        return [stage.device for stage in strategy.stage_map()]
    if isinstance(strategy, ParameterServerStrategy):  # each worker task runs steps on its CPU
        return [f"worker:{index}" for index in range(strategy.num_workers)]
    return [r.device for r in explanation.replicas]
