"""Writing a single-file backup on a thread, so that training waits only for a copy of the state.

`BackupAndRestore(async_save=True)`: at the step boundary the chief copies the state (`snapshot`: every
tensor copied to the CPU, into the buffers of the copy before: one more copy of the state in memory), then a thread writes the copy with `save_checkpoint`, atomically as ever (a
temporary file, fsync, renames), while training goes on. At most one write is in flight: the next save,
the end of training and a stop on a signal first wait for it, and an error of the write is raised there.
A process killed during the write leaves the backups before it whole (the temporary never loads).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch


def snapshot(state: Any, into: Any = None) -> Any:
    """`state` with every tensor copied to the CPU (containers copied, other values kept): what the step boundary
    held, whatever training does to the originals afterwards. `into`: an earlier snapshot whose tensors of the
    same shape and dtype are written over instead of allocated again (a copy into memory already touched runs
    several times faster than into fresh pages); nothing may still read it."""
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    copied = _snapshot(state, into, pending)
    copy_bytes_(pending)
    return copied


def _snapshot(state: Any, into: Any, pending: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    if isinstance(state, torch.Tensor):
        if (
            isinstance(into, torch.Tensor)
            and into.device.type == "cpu"
            and into.shape == state.shape
            and into.dtype == state.dtype
        ):
            if _plain_bytes(state) and _plain_bytes(into):
                pending.append((into, state))
                return into
            return into.copy_(state.detach())
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        earlier = into if isinstance(into, dict) else {}
        return {key: _snapshot(value, earlier.get(key), pending) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        earlier_items = (
            list(into) if isinstance(into, (list, tuple)) and len(into) == len(state) else [None] * len(state)
        )
        items = [_snapshot(value, before, pending) for value, before in zip(state, earlier_items)]
        return items if isinstance(state, list) else tuple(items)
    return state


def _plain_bytes(tensor: torch.Tensor) -> bool:
    """A dense CPU tensor whose values are its bytes in order (no subclass, view bits, or gaps)."""
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not tensor.is_quantized
    )


_CHUNK = 16 << 20


def copy_bytes_(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copies each ``(destination, source)`` pair of `_plain_bytes` tensors of one size, in pieces of 16 MiB on up
    to ``torch.get_num_threads()`` threads of their own. Not ``copy_``: torch's intra-op threads wait for each
    other by spinning, so when the machine has more busy threads than cores one descheduled thread holds up the
    copy (measured: 144 MiB took 0.5-1.2 s with ``copy_`` on 2 threads against 0.1-0.3 s so, on 2 loaded cores).
    memmove runs without the GIL, and a thread that finishes waits for the others without spinning."""
    pieces: list[tuple[int, int, int]] = []
    for destination, source in pairs:
        size = source.numel() * source.element_size()
        to, start = destination.data_ptr(), source.data_ptr()
        pieces.extend((to + offset, start + offset, min(_CHUNK, size - offset)) for offset in range(0, size, _CHUNK))
    workers = min(torch.get_num_threads(), len(pieces))
    if workers <= 1:
        for piece in pieces:
            ctypes.memmove(*piece)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="stratagem-backup-copy") as pool:
        list(pool.map(lambda piece: ctypes.memmove(*piece), pieces))


class BackgroundWrite:
    """At most one write running on a thread; `wait` joins it and raises its error."""

    def __init__(self, timeout: float = 600.0) -> None:
        self.timeout = timeout
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._what = ""

    def start(self, write: Callable[[], object], what: str) -> None:
        """Waits for the write before (raising its error), then runs `write` on a new thread."""
        self.wait()
        self._what = what

        def run() -> None:
            try:
                write()
            except BaseException as error:  # noqa: BLE001 - handed to the training thread at its next wait
                self._error = error

        self._thread = threading.Thread(target=run, name="stratagem-backup-write", daemon=True)
        self._thread.start()

    @property
    def idle(self) -> bool:
        """No write runs (none started, or the last one ended)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Returns once no write runs; raises the error of the one that just ended, if it failed."""
        thread = self._thread
        if thread is not None:
            thread.join(self.timeout)
            if thread.is_alive():  # kept: `idle` stays False, and the next wait joins it again
                raise TimeoutError(
                    f"The background write of {self._what} did not finish in {self.timeout:.0f} s. Received: a write "
                    "still running. Check the disk or file system of the backup directory (a hung network mount?)."
                )
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
