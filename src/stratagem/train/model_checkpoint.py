"""`ModelCheckpoint`: the model's weights saved by the chief, every N epochs or at the best epoch.

Each file is written atomically: to a temporary file in the same directory, flushed to disk, then
renamed over the target, so a process killed while saving leaves the previous file or the new
one, never a torn one. Two formats:

- ``"state_dict"``: ``torch.save(model.state_dict())``; read back with
  ``model.load_state_dict(torch.load(path, weights_only=True))``.
- ``"safetensors"``: the same tensors in the safetensors format (the optional ``safetensors``
  package); read back with ``safetensors.torch.load_file(path)``.

Example:
    >>> best = sg.callbacks.ModelCheckpoint("ckpt/best.safetensors", monitor="val_loss", save_best_only=True,
    ...                                     format="safetensors")
    >>> every = sg.callbacks.ModelCheckpoint("ckpt/epoch{epoch:03d}.pt", every_n_epochs=5)
    >>> sg.fit(strategy, net, optimizer, F.cross_entropy, data, epochs=50, validation_data=val, callbacks=[best, every])
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from stratagem.errors import InputError
from stratagem.train.callback import Callback
from stratagem.train.early_stopping import monitored_value, resolve_mode

if TYPE_CHECKING:
    from stratagem.train.fit_state import EpochLog, TrainingContext

logger = logging.getLogger(__name__)

FORMATS = ("state_dict", "safetensors")


def write_atomically(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Writes a file through `write(handle)` into a temporary file beside `path`, fsyncs it, renames it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())  # the bytes are on disk before the name points at them
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise


def _safetensors_bytes(state: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    # safetensors refuses tensors that share memory (tied weights) and non-contiguous views: give it copies.
    return save({name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in state.items()})


class ModelCheckpoint(Callback):
    """Saves the model's weights (on the chief only) every `every_n_epochs` epochs, or when `monitor` improves.

    Args:
        filepath: where to write; may name the epoch and any metric of the epoch log,
            e.g. ``"ckpt/epoch{epoch:02d}-{val_loss:.3f}.pt"``.
        monitor, mode, min_delta: with `save_best_only`, the metric whose improvement triggers a save
            (mode "auto": max for accuracies, else min).
        save_best_only: save only when `monitor` improves on the best so far.
        every_n_epochs: without `save_best_only`, save after every N-th epoch (and after the last).
        format: ``"state_dict"`` (torch.save) or ``"safetensors"``.

    ``saved`` lists the paths written, in order (on the chief).
    """

    def __init__(
        self,
        filepath: str | os.PathLike[str],
        *,
        monitor: str = "val_loss",
        mode: str = "auto",
        min_delta: float = 0.0,
        save_best_only: bool = False,
        every_n_epochs: int = 1,
        format: str = "state_dict",
    ) -> None:
        if isinstance(filepath, bool) or not isinstance(filepath, (str, os.PathLike)) or not str(filepath):
            raise InputError(
                f"filepath must be a file path. Received: filepath={filepath!r}. Use e.g. 'ckpt/model.pt'."
            )
        if format not in FORMATS:
            raise InputError(f"Unknown checkpoint format. Received: format={format!r}. Use one of {FORMATS}.")
        if format == "safetensors":
            try:
                import safetensors.torch  # noqa: F401
            except ImportError:
                raise InputError(
                    "format='safetensors' needs the safetensors package, which is not installed. Received: "
                    "format='safetensors'. Install it (pip install safetensors) or use format='state_dict'."
                ) from None
        if isinstance(every_n_epochs, bool) or not isinstance(every_n_epochs, int) or every_n_epochs < 1:
            raise InputError(f"every_n_epochs must be a positive integer. Received: every_n_epochs={every_n_epochs!r}.")
        self.filepath = str(filepath)
        self.monitor = monitor
        self.mode = resolve_mode(mode, monitor)
        self.min_delta = float(min_delta)
        self.save_best_only = save_best_only
        self.every_n_epochs = every_n_epochs
        self.format = format
        self.best = math.inf if self.mode == "min" else -math.inf
        self.saved: list[Path] = []

    def on_epoch_end(self, context: TrainingContext, log: EpochLog) -> None:
        if self.save_best_only:
            value = monitored_value(log, self.monitor, "ModelCheckpoint")
            better = value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta
            if not better:
                return
            self.best = value
        elif log.epoch % self.every_n_epochs and log.epoch != context.epochs:
            return
        # Every worker reads the state (the same on each); only the chief writes: one writer per file.
        if context.is_chief:
            self._save(context.model.state_dict(), log)

    def _path(self, log: EpochLog) -> Path:
        try:
            return Path(self.filepath.format(epoch=log.epoch, **log.metrics))
        except (KeyError, IndexError, ValueError) as error:
            raise InputError(
                f"ModelCheckpoint's filepath names a value the epoch log does not have. Received: filepath="
                f"{self.filepath!r} ({type(error).__name__}: {error}); it can use epoch and {sorted(log.metrics)}."
            ) from None

    def _save(self, state: dict[str, torch.Tensor], log: EpochLog) -> None:
        path = self._path(log)
        if self.format == "safetensors":
            payload = _safetensors_bytes(state)
            write_atomically(path, lambda handle: handle.write(payload))
        else:
            cpu_state = {name: tensor.detach().to("cpu") for name, tensor in state.items()}
            write_atomically(path, lambda handle: torch.save(cpu_state, handle))
        self.saved.append(path)
        logger.info("ModelCheckpoint: saved epoch %d to %s.", log.epoch, path)

    # The best value so far travels in backups, so a restarted run does not overwrite a better checkpoint.
    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = float(state["best"])
