"""Counters in a shared mapping: how one process tells another that what it wrote there is ready.

A process writes its data, then stores a counter (an aligned 8-byte store); the other reads the
counter, then the data. x86-64 keeps stores in order and loads in order (total store order), so a
counter seen at ``n`` means the data written before it is visible; other architectures would need
fences Python cannot issue, which is why the users of this module check
``eligibility.ordered_stores`` first.

A waiting process polls for a short while (a peer microseconds behind is caught without a system
call), then sleeps on the counter's low 32 bits with Linux's futex(2), called through ctypes (the
call releases the GIL while it sleeps); the process that moves a counter wakes its sleepers. A
sleep lasts at most ``check_every`` seconds, after which the waiter's own ``check`` decides whether
to go on (a peer gone, the clock run out): no wait is unbounded.
"""

from __future__ import annotations

import ctypes
import mmap
import time
from collections.abc import Callable
from typing import Any

import numpy

# Linux x86-64 futex(2): sleep while a 32-bit word holds a value, wake the sleepers of a word.
_SYS_FUTEX = 202
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_libc: ctypes.CDLL | None = None


class Stop(Exception):
    """Raised by a wait's check to stop waiting (not an error)."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall() -> Callable[..., Any]:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)  # calls release the GIL while they sleep
    return _libc.syscall


def futex_wake(address: int) -> None:
    """Wakes every process sleeping on the 32-bit word at ``address`` (see ``futex_wait``)."""
    _syscall()(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(address),
        ctypes.c_long(_FUTEX_WAKE),
        ctypes.c_long(2**31 - 1),
        None,
        None,
        ctypes.c_long(0),
    )


def futex_wait(address: int, seen: int, seconds: float) -> None:
    """Sleeps while the low 32 bits of the counter at ``address`` still hold those of ``seen``, at most
    ``seconds`` (a change and a ``futex_wake`` end it at once; a change before the call, at once too)."""
    pause = _Timespec(int(seconds), int((seconds % 1) * 1e9))
    _syscall()(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(address),
        ctypes.c_long(_FUTEX_WAIT),
        ctypes.c_long(seen & 0xFFFFFFFF),
        ctypes.byref(pause),
        None,
        ctypes.c_long(0),
    )


class Counters:
    """``count`` 8-byte counters at ``offset`` bytes into ``mapping``, as ``words`` (a numpy int64 view).

    ``close()`` drops this object's hold on the mapping (its views), so the mapping itself can be closed.
    """

    def __init__(self, mapping: mmap.mmap, *, count: int, offset: int = 0) -> None:
        self.words = numpy.frombuffer(mapping, dtype=numpy.int64, count=count, offset=offset)
        self._anchor = ctypes.c_char.from_buffer(mapping)
        self._base = ctypes.addressof(self._anchor) + offset

    def publish(self, index: int, value: int) -> None:
        """Stores ``value`` in counter ``index`` (after everything written before it) and wakes its sleepers."""
        self.words[index] = value
        futex_wake(self._base + index * 8)

    def wake(self, index: int) -> None:
        """Wakes the sleepers of counter ``index`` without moving it (they run their check at once)."""
        futex_wake(self._base + index * 8)

    def wait(self, index: int, target: int, *, spin: float, check_every: float, check: Callable[[], None]) -> None:
        """Returns once counter ``index`` reaches ``target``: polls for ``spin`` seconds, then sleeps on it, and
        calls ``check`` after each sleep of at most ``check_every`` seconds that did not see it (``check`` raises
        to give up: an error, or ``Stop``)."""
        words = self.words
        spin_until = time.perf_counter() + spin
        while time.perf_counter() < spin_until:
            if words[index] >= target:
                return
        address = self._base + index * 8
        while True:
            seen = int(words[index])
            if seen >= target:
                return
            futex_wait(address, seen, check_every)
            if words[index] >= target:
                return
            check()

    def close(self) -> None:
        self.words = self._anchor = None  # type: ignore[assignment]
