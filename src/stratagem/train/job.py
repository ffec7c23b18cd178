"""The digits job behind ``stratagem train``: choose the devices, train, evaluate, report.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from stratagem import environ
from stratagem.data.resume import ShuffledBatches
from stratagem.devices import DeviceRegistry, default_registry
from stratagem.diagnose import PlacementDecision, collect_facts, gpu_unavailable_reason
from stratagem.errors import DeviceError, InputError
from stratagem.strategies import (
    CentralStorageStrategy,
    MirroredStrategy,
    ModelParallelStrategy,
    MultiWorkerMirroredStrategy,
    OneDeviceStrategy,
    ParameterServerStrategy,
    Strategy,
)
from stratagem.train.callbacks import Callback
from stratagem.train.digits import build_digits_model, load_digits_data, make_loader
from stratagem.train.fit import EpochLog, fit
from stratagem.train.loop import Evaluation, evaluate

StrategyBuilder = Callable[[list[str], DeviceRegistry], Strategy]

STRATEGY_BUILDERS: dict[str, StrategyBuilder] = {
    "mirrored": lambda names, registry: MirroredStrategy(names, registry=registry),
    "one_device": lambda names, registry: OneDeviceStrategy(names[0], registry=registry),
    "multi_worker": lambda names, registry: MultiWorkerMirroredStrategy(names, registry=registry),
    "central_storage": lambda names, registry: CentralStorageStrategy(names, registry=registry),
    # Two micro-batches per global batch, so the stages really work at the same time (GPipe).
    "model_parallel": lambda names, registry: ModelParallelStrategy(
        stages=names, num_micro_batches=MODEL_PARALLEL_MICRO_BATCHES, registry=registry),
    # The cluster (chief, workers, parameter servers) comes from TF_CONFIG, as `stratagem launch --ps` sets it.
    "parameter_server": lambda names, registry: ParameterServerStrategy(),
}
"""How ``stratagem train`` builds each strategy from its devices; add an entry (and, if its default
devices differ, a branch in `_default_devices`) to offer another strategy."""

STRATEGY_NAMES = tuple(STRATEGY_BUILDERS)
"""The strategies ``stratagem train`` can build, by their command-line name."""

TARGET_ACCURACY = 0.95
"""The test accuracy the default run must reach."""

MODEL_PARALLEL_MICRO_BATCHES = 2

# Two logical CPU replicas on a CPU-only machine: the smallest setup that really exercises the
# gradient combination, and more replicas than cores would only oversubscribe them.
DEFAULT_CPU_REPLICAS = 2


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The settings of one digits training run; the defaults reach 95% test accuracy."""

    strategy: str = "mirrored"
    """One of `STRATEGY_NAMES`."""
    devices: tuple[str, ...] | None = None
    """Device names in TF or torch spelling; None lets `build_strategy` choose."""
    epochs: int = 10
    batch_size: int = 64
    """The GLOBAL batch, split among the replicas."""
    lr: float = 3e-3
    """Adam's learning rate."""
    seed: int = 0
    """Seeds the model's initial weights and the shuffle order; same seed, same numbers."""
    precision: str = "32"
    """"32", "bf16" or "fp16" (GPUs only): `fit`'s precision setting."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGY_NAMES:
            raise InputError(f"Unknown strategy. Received: strategy={self.strategy!r}. Choose one of {', '.join(STRATEGY_NAMES)}.")
        for name in ("epochs", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive integer. Received: {name}={value!r}.")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise InputError(f"lr must be a positive finite number. Received: lr={self.lr!r}. Try lr=0.003.")

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "devices": list(self.devices) if self.devices else None,
                "epochs": self.epochs, "batch_size": self.batch_size, "lr": self.lr, "seed": self.seed,
                "precision": self.precision}


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
    """Wall time of the training steps alone (no evaluation, no set-up)."""
    elapsed_s: float
    """Wall time of the whole run: data, model, training and evaluation."""
    num_train_examples: int

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
            "epochs": [{"epoch": e.epoch, "loss": e.metrics["loss"], "accuracy": e.metrics["accuracy"]}
                       for e in self.history],
            "test_loss": self.test["loss"],
            "test_accuracy": self.test["accuracy"],
            "num_test_examples": self.test.num_examples,
            "target_accuracy": TARGET_ACCURACY,
            "reached_target": self.reached_target,
            "num_train_examples": self.num_train_examples,
            "train_time_s": self.train_time_s,
            "samples_per_s": self.samples_per_s,
            "elapsed_s": self.elapsed_s,
            "explanation": self.explanation,
        }


def build_strategy(name: str, devices: Sequence[str] | None = None, *,
                   registry: DeviceRegistry | None = None) -> tuple[Strategy, PlacementDecision]:
    """The strategy ``name`` over ``devices``, or over the devices chosen for this machine, and why.

    Without devices, ``mirrored`` uses every GPU, or on a machine without one two logical CPU
    replicas (one if the CPU has a single logical device); ``one_device`` uses ``cuda:0`` when a
    GPU is visible, else ``cpu:0``.

    Example:
        >>> strategy, decision = build_strategy("mirrored", ["cpu:0", "cpu:1"])
        >>> strategy.num_replicas_in_sync, decision.reason
        (2, 'given by --devices')

    Raises:
        InputError: ``name`` is not one of `STRATEGY_NAMES`.
        DeviceError: a device is unknown or unavailable, or ``one_device`` was given several.
    """
    registry = registry or default_registry
    if name not in STRATEGY_NAMES:
        raise InputError(f"Unknown strategy. Received: {name!r}. Choose one of {', '.join(STRATEGY_NAMES)}.")
    if devices is not None:
        names = list(devices)
        if name == "one_device" and len(names) != 1:
            raise DeviceError(
                f"The one_device strategy runs on exactly one device. Received: devices={names}. "
                "Name one device (e.g. --devices cuda:0) or use --strategy mirrored for several."
            )
        decision = PlacementDecision(subject="devices", choice=", ".join(names), reason="given by --devices")
    else:
        names, decision = _default_devices(name, registry)
    return STRATEGY_BUILDERS[name](names, registry), decision


def _default_devices(name: str, registry: DeviceRegistry) -> tuple[list[str], PlacementDecision]:
    gpus = [d.name for d in registry.get_logical_devices("cuda")]
    if gpus:
        chosen = gpus[:1] if name == "one_device" else gpus
        reason = "the first visible GPU" if name == "one_device" else f"every visible GPU ({len(gpus)})"
        return chosen, PlacementDecision(subject="devices", choice=", ".join(chosen), reason=reason)
    why = gpu_unavailable_reason(collect_facts(environ.current()))
    no_gpu = f"no usable GPU: {why.reason}" if why is not None else "no usable GPU"
    cpus = [d.name for d in registry.get_logical_devices("cpu")]
    if name in ("multi_worker", "parameter_server"):
        # One replica per worker process: the workers already share the cores between them.
        return cpus[:1], PlacementDecision(subject="devices", choice=cpus[0],
                                           reason=f"{no_gpu} So one CPU replica per worker process.")
    if name == "one_device":
        return cpus[:1], PlacementDecision(subject="devices", choice=cpus[0], reason=f"{no_gpu} So the CPU.")
    chosen = cpus[:DEFAULT_CPU_REPLICAS]
    what = "stage(s)" if name == "model_parallel" else "replica(s)"
    reason = (f"{no_gpu} So {len(chosen)} logical CPU {what} out of the {len(cpus)} logical CPU device(s), "
              f"to train {name} on the CPU. Choose others with --devices.")
    return chosen, PlacementDecision(subject="devices", choice=", ".join(chosen), reason=reason)


def train_digits(config: TrainConfig, strategy: Strategy, device_decision: PlacementDecision, *,
                 callbacks: Sequence[Callback] = ()) -> TrainReport:
    """Trains the digits conv net with Adam under ``strategy`` with `fit`, then evaluates it on the test split.

    ``callbacks`` go to `fit` (the CLI passes a progress bar, and a backup with ``--backup-dir``).
    """
    start = time.perf_counter()
    data = load_digits_data()
    net = build_digits_model(config.seed)
    # The order of each epoch depends only on (seed, epoch): the same run repeats exactly, and resumes exactly.
    train = ShuffledBatches((data.train_x, data.train_y), config.batch_size, seed=config.seed)
    history = fit(strategy, net, torch.optim.Adam(net.parameters(), lr=config.lr), F.cross_entropy, train,
                  epochs=config.epochs, metrics=["accuracy"], callbacks=callbacks, precision=config.precision)
    test_loader = make_loader(data.test_x, data.test_y, config.batch_size, shuffle=False)
    test = evaluate(strategy, history.model, test_loader, F.cross_entropy, metrics=["accuracy"])
    explanation = strategy.explain()
    return TrainReport(
        config=config,
        devices=_devices_used(strategy, explanation),
        device_decision=device_decision,
        explanation=explanation.to_dict(),
        history=history.epochs,
        test=test,
        train_time_s=sum(e.elapsed_s for e in history.epochs),
        elapsed_s=time.perf_counter() - start,
        num_train_examples=sum(e.num_examples for e in history.epochs),
    )


def _devices_used(strategy: Strategy, explanation: Any) -> list[str]:
    if isinstance(strategy, ModelParallelStrategy):  # one replica, spread over the stages' devices
        return [stage.device for stage in strategy.stage_map()]
    if isinstance(strategy, ParameterServerStrategy):  # each worker task runs steps on its CPU
        return [f"worker:{index}" for index in range(strategy.num_workers)]
    return [r.device for r in explanation.replicas]
