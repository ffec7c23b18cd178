"""The one place that reads the process environment.

Everything else takes a ``Mapping[str, str]`` as an argument, so tests pass constructed
environments and nothing reads ``os.environ`` behind the caller's back.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def current() -> Mapping[str, str]:
    """A snapshot of the process environment."""
    return dict(os.environ)


def set_default(name: str, value: str) -> None:
    """Sets an environment variable for this process and its children unless it is already set.

    Used for settings that libraries read from the environment only (GLOO_SOCKET_IFNAME).
    """
    os.environ.setdefault(name, value)


SHARED_MEMORY = "STRATAGEM_SHARED_MEMORY"
"""Set to 0 to turn off every shared-memory transport (the multi-worker sums, the parameter server's files)."""


def shared_memory_setting(env: Mapping[str, str] | None = None) -> str | None:
    """``STRATAGEM_SHARED_MEMORY`` as set in ``env`` (default: this process's environment), stripped, or None
    when it is unset or empty. ``stratagem.shm.eligibility`` says what the values mean."""
    value = (current() if env is None else env).get(SHARED_MEMORY, "").strip()
    return value or None


NATIVE_BATCH_NORM = "STRATAGEM_NATIVE_BATCH_NORM"
"""Set to 0 to run exact BatchNorm's meetings in Python even where the native ones are built (the same results,
slower between CPU replica threads of one process)."""


def native_batch_norm_setting(env: Mapping[str, str] | None = None) -> str | None:
    """``STRATAGEM_NATIVE_BATCH_NORM`` as set in ``env`` (default: this process's environment), stripped, or None."""
    value = (current() if env is None else env).get(NATIVE_BATCH_NORM, "").strip()
    return value or None


def torch_extensions_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where torch's extension builder keeps what it builds: ``TORCH_EXTENSIONS_DIR``, else ~/.cache/torch_extensions
    (torch's own default)."""
    value = (current() if env is None else env).get("TORCH_EXTENSIONS_DIR", "").strip()
    return Path(value) if value else Path.home() / ".cache" / "torch_extensions"


TRACE = "STRATAGEM_TRACE"
"""A directory: every MultiWorkerMirroredStrategy of the process traces its steps there (`stratagem launch --trace`)."""


def trace_dir(env: Mapping[str, str] | None = None) -> str | None:
    """``STRATAGEM_TRACE`` as set in ``env`` (default: this process's environment), stripped, or None when it is
    unset or empty."""
    value = (current() if env is None else env).get(TRACE, "").strip()
    return value or None


FLIGHT_DIR = "STRATAGEM_FLIGHT_DIR"
"""A directory: where each worker writes its record of its last collectives when one fails or times out."""


def flight_dir(env: Mapping[str, str] | None = None) -> str | None:
    """``STRATAGEM_FLIGHT_DIR`` as set in ``env`` (default: this process's environment), stripped, or None."""
    value = (current() if env is None else env).get(FLIGHT_DIR, "").strip()
    return value or None
