"""Training on top of the strategies: `fit`, metrics, callbacks, checkpoints, and the digits job.

Example:
    >>> from stratagem.train import fit, BackupAndRestore
    >>> history = fit(strategy, net, optimizer, F.cross_entropy, (x, y), batch_size=64, epochs=3,
    ...               metrics=["accuracy"], callbacks=[BackupAndRestore("/tmp/backup")])
    >>> history.history["accuracy"]
"""

from stratagem.train.callbacks import (
    BackupAndRestore,
    Callback,
    CSVLogger,
    EarlyStopping,
    LearningRateScheduler,
    ModelCheckpoint,
    ProgressBar,
    TensorBoard,
    format_epoch_line,
)
from stratagem.train.checkpoint import (
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from stratagem.train.digits import (
    DigitsData,
    build_digits_model,
    load_digits_data,
    make_loader,
)
from stratagem.train.fit import EpochLog, History, TrainingContext, fit, is_chief
from stratagem.train.job import (
    STRATEGY_BUILDERS,
    STRATEGY_NAMES,
    TARGET_ACCURACY,
    TrainConfig,
    TrainReport,
    build_strategy,
    train_digits,
)
from stratagem.train.loop import (
    Evaluation,
    evaluate,
    run_steps,
    run_steps_synchronously,
)
from stratagem.train.metrics import (
    METRICS,
    Accuracy,
    BinaryAccuracy,
    MeanAbsoluteError,
    MeanSquaredError,
    Metric,
    MetricSet,
    get_metrics,
)
from stratagem.train.seeding import seed_everything

__all__ = [
    "METRICS",
    "STRATEGY_BUILDERS",
    "STRATEGY_NAMES",
    "TARGET_ACCURACY",
    "Accuracy",
    "BackupAndRestore",
    "BinaryAccuracy",
    "CSVLogger",
    "Callback",
    "DigitsData",
    "EarlyStopping",
    "EpochLog",
    "Evaluation",
    "History",
    "LearningRateScheduler",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "Metric",
    "MetricSet",
    "ModelCheckpoint",
    "ProgressBar",
    "TensorBoard",
    "TrainConfig",
    "TrainReport",
    "TrainingContext",
    "build_digits_model",
    "build_strategy",
    "capture_rng_state",
    "evaluate",
    "fit",
    "format_epoch_line",
    "get_metrics",
    "is_chief",
    "load_checkpoint",
    "load_digits_data",
    "make_loader",
    "restore_rng_state",
    "run_steps",
    "run_steps_synchronously",
    "save_checkpoint",
    "seed_everything",
    "train_digits",
]
