"""Autocast across threads: the caller's `torch.autocast` state, carried to the replica threads.

Autocast is thread-local in torch, so a replica thread started before `strategy.run` does not see
an autocast the caller entered around `run`: only replica 0 (the caller's thread) would compute in
bf16. `capture_autocast()` reads the caller's state for every device type stratagem runs on, and
`apply_autocast(state)` enters the same autocast in another thread for the length of a job.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class AutocastState:
    """Which device types have autocast on in the capturing thread, with which dtype."""

    enabled: tuple[tuple[str, torch.dtype], ...]
    cache_enabled: bool


def capture_autocast() -> AutocastState | None:
    """The calling thread's autocast state; None when autocast is off for every device type."""
    enabled = tuple((kind, torch.get_autocast_dtype(kind)) for kind in _DEVICE_TYPES if torch.is_autocast_enabled(kind))
    if not enabled:
        return None
    return AutocastState(enabled, torch.is_autocast_cache_enabled())


@contextlib.contextmanager
def apply_autocast(state: AutocastState | None) -> Iterator[None]:
    """Enters the captured autocast state in this thread (nothing for None)."""
    if state is None:
        yield
        return
    with contextlib.ExitStack() as stack:
        for kind, dtype in state.enabled:
            stack.enter_context(torch.autocast(kind, dtype=dtype, cache_enabled=state.cache_enabled))
        yield
