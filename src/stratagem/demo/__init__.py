"""The demo: the job ``stratagem train`` runs on its embedded default, the digits conv net.

Not part of the training library: it sits above `stratagem.train`, beside `stratagem.cli`, and
nothing in the library imports it. It shows one complete run of `fit` under a strategy chosen by
name (`stratagem.strategies.by_name`): scikit-learn's 8x8 digits, a small conv net, Adam, a test
evaluation and a report of where the work ran.

- `digits`: the data (no download) and the model.
- `job`: `TrainConfig`, `train_digits` and its `TrainReport`.

Example:
    >>> from stratagem.demo import TrainConfig, train_digits
    >>> from stratagem.strategies.by_name import build_strategy
    >>> config = TrainConfig(epochs=2)
    >>> strategy, decision = build_strategy(config.strategy, config.devices)
    >>> try:
    ...     report = train_digits(config, strategy, decision)
    ... finally:
    ...     strategy.close()
    >>> report.reached_target
"""

from stratagem.demo.digits import DigitsData, build_digits_model, load_digits_data, make_loader
from stratagem.demo.job import TARGET_ACCURACY, TrainConfig, TrainReport, train_digits

__all__ = [
    "TARGET_ACCURACY",
    "DigitsData",
    "TrainConfig",
    "TrainReport",
    "build_digits_model",
    "load_digits_data",
    "make_loader",
    "train_digits",
]
