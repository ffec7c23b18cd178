"""Training on top of the strategies: `fit`, metrics, callbacks, checkpoints.

Example:
    >>> from stratagem.train import fit, BackupAndRestore
    >>> history = fit(strategy, net, optimizer, F.cross_entropy, (x, y), batch_size=64, epochs=3,
    ...               metrics=["accuracy"], callbacks=[BackupAndRestore("/tmp/backup")])
    >>> history.history["accuracy"]
"""

from stratagem.train.callback import Callback
from stratagem.train.callbacks import BackupAndRestore, LearningRateScheduler, ProgressBar, format_epoch_line
from stratagem.train.checkpoint import (
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from stratagem.train.early_stopping import EarlyStopping
from stratagem.train.fit import EpochLog, History, TrainingContext, fit, is_chief
from stratagem.train.loggers import CSVLogger, TensorBoard
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
from stratagem.train.model_checkpoint import ModelCheckpoint
from stratagem.train.seeding import seed_everything

__all__ = [
    "METRICS",
    "Accuracy",
    "BackupAndRestore",
    "BinaryAccuracy",
    "CSVLogger",
    "Callback",
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
    "TrainingContext",
    "capture_rng_state",
    "evaluate",
    "fit",
    "format_epoch_line",
    "get_metrics",
    "is_chief",
    "load_checkpoint",
    "restore_rng_state",
    "run_steps",
    "run_steps_synchronously",
    "save_checkpoint",
    "seed_everything",
]
