"""Training on top of the strategies: the digits example job, epoch and evaluation loops.

Example:
    >>> from stratagem.train import TrainConfig, build_strategy, train_digits
    >>> config = TrainConfig(epochs=3)
    >>> strategy, decision = build_strategy("mirrored", ["cpu:0", "cpu:1"])
    >>> report = train_digits(config, strategy, decision)
    >>> report.test.accuracy
"""

from stratagem.train.digits import DigitsData, build_digits_model, load_digits_data, make_loader
from stratagem.train.job import (
    STRATEGY_NAMES,
    TARGET_ACCURACY,
    TrainConfig,
    TrainReport,
    build_strategy,
    train_digits,
)
from stratagem.train.loop import EpochResult, EvalResult, evaluate, train_epoch

__all__ = [
    "DigitsData",
    "EpochResult",
    "EvalResult",
    "STRATEGY_NAMES",
    "TARGET_ACCURACY",
    "TrainConfig",
    "TrainReport",
    "build_digits_model",
    "build_strategy",
    "evaluate",
    "load_digits_data",
    "make_loader",
    "train_digits",
    "train_epoch",
]
