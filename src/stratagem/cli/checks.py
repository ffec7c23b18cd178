"""Checks the commands make on their arguments before any work, with errors in command-line spelling.

The library's own errors suggest Python calls (``sg.devices.set_logical_device_configuration``);
a command-line user needs the flag to change instead, so the commands check what they can first.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from stratagem.devices import get_logical_devices
from stratagem.devices.names import parse_device
from stratagem.errors import InputError
from stratagem.strategies.records import STRATEGIES
from stratagem.trace import Traceable


def check_device_flags(names: Sequence[str], flag: str = "--devices") -> None:
    """Refuses device names out of this machine's range, saying which names the flag can take."""
    for name in names:
        spec = parse_device(name)  # an unknown spelling raises the library's DeviceError, which names the forms
        if spec.device_type not in ("cpu", "cuda") or spec.task is not None:
            continue
        have = get_logical_devices(spec.device_type)
        index = spec.index or 0
        if spec.device_type == "cuda" and not have:
            raise InputError(
                f"{flag} names a GPU, but no GPU is visible to torch. Received: {flag} {','.join(names)}. Run "
                f"`stratagem doctor` to see why, or train on the CPU: {flag} cpu:0 (or leave {flag} out)."
            )
        if index >= len(have):
            kind = "CPU" if spec.device_type == "cpu" else "GPU"
            span = f"{spec.device_type}:0..{spec.device_type}:{len(have) - 1}"
            hint = "" if spec.device_type == "cpu" else " (CUDA_VISIBLE_DEVICES renumbers the visible GPUs from 0)"
            raise InputError(
                f"{flag} names {name}, which is out of range: this machine has {len(have)} logical {kind} device(s), "
                f"{span}{hint}. "
                f"Received: {flag} {','.join(names)}. Name devices in {span}, e.g. {flag} "
                f"{','.join(f'{spec.device_type}:{i}' for i in range(min(2, len(have))))}."
            )


def check_writable_directory(path: str | os.PathLike[str], flag: str) -> Path:
    """Proves `path` can hold files (creating a file there and removing it) before any work starts.

    Directories that had to be created for the check are removed again, so a run that fails
    later leaves nothing behind; the run creates them when it writes.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(
            f"{flag} must be a directory. Received: {flag} {path}, which is a file. Name a directory "
            "(it is created if missing)."
        )
    created = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".stratagem-write-check-"):
            pass
    except OSError as error:
        raise InputError(
            f"{flag}: cannot write into {path} ({error.strerror or error}). Received: {flag} {path}. "
            "Choose a directory you can write to."
        ) from None
    finally:
        for directory in created:  # deepest first
            try:
                directory.rmdir()
            except OSError:
                pass
    return path


def traced_strategy_names() -> list[str]:
    """The strategies that `stratagem train --trace` can trace (their class is a `Traceable`)."""
    return [record.name for record in STRATEGIES if issubclass(record.strategy_class, Traceable)]


def check_trace_flag(strategy: str, directory: str) -> None:
    """Refuses `--trace DIR` with a strategy that records no trace, before any work."""
    if not issubclass(STRATEGIES[strategy].strategy_class, Traceable):
        raise InputError(
            f"--strategy {strategy} does not record traces yet. Received: --strategy {strategy} --trace {directory}. "
            f"Use --strategy {' or '.join(traced_strategy_names())}, or leave --trace out."
        )
