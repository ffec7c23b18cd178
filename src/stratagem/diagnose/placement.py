"""The placement log and soft placement: where every operation ran, and what to do when an
operation has no kernel on its device.

    with sg.log_placement() as log:
        for x, y in dataset:
            strategy.run(train_step, args=(x, y))
    print(log.summary())        # operations per device, copies per step, operations off their device

Both are a torch dispatch mode (`TorchDispatchMode`), which sees every aten (and custom)
operation with its tensors. A dispatch mode belongs to one thread:

- torch carries it into its own autograd threads (a GPU's backward pass runs on a thread of
  torch's), which the tests check on a second device;
- threads that stratagem starts (replicas, pipeline stages) take it along explicitly:
  ``captured = capture_placement()`` on the thread that hands out the work, then
  ``with apply_placement(captured):`` on the thread that does it.

When no log and no soft placement is active nothing is entered: `capture_placement()` returns
None and `apply_placement(None)` does nothing, so an unlogged step pays nothing.

"The replica's device" is what `stratagem.strategies.replica_context.enter_replica` reports through
`note_replica` (this layer sits below the strategies and does not import them), else the
log's `device=`, else unknown (no operation is then judged off its device).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from types import EllipsisType
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stratagem.diagnose import soft_placement as fallback
from stratagem.diagnose.placement_report import PlacementSummary, summarize
from stratagem.errors import InputError

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11

_aten = torch.ops.aten
_thread = threading.local()  # .mode: the _PlacementMode this thread entered; .replica: _Replica | None


@dataclass(frozen=True)
class _Replica:
    """Whose work a thread does: a replica (None: no replica, e.g. a stage thread outside
    `strategy.run`) and the device its operations belong on (None: unknown)."""

    replica: int | None
    device: torch.device | None


class PlacementLog:
    """Records, for the code it wraps, every operation with its device, every copy between devices
    with its bytes, and every operation that ran on a device other than its replica's.

    Build it with `log_placement()`. Counts are kept, not a line per operation, so a long run
    stays small; `summary()` gives the report and `count()` any single figure.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._ops: Counter[tuple[str, str, int | None]] = Counter()
        self._copies: Counter[tuple[str, str, str | None]] = Counter()
        self._copy_bytes: Counter[tuple[str, str, str | None]] = Counter()
        self._off_device: Counter[tuple[str, str, str, str | None]] = Counter()
        self._steps = 0
        self._region: contextlib.AbstractContextManager | None = None
        self._used = False

    def __enter__(self) -> Self:
        if self._used:
            raise InputError(
                "A placement log records one region and this one was already entered. "
                "Received: a second `with` on the same log. Use a new `sg.log_placement()`."
            )
        self._used = True
        self._region = _join(logs=(self,))
        self._region.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        region, self._region = self._region, None
        if region is not None:
            region.__exit__(*exc)

    @property
    def steps(self) -> int:
        """Steps seen: each `strategy.run` inside the log (its replica 0 starting), and each `step()`."""
        return self._steps

    def step(self) -> None:
        """Marks the start of a step, for code that does not go through `strategy.run`."""
        with self._lock:
            self._steps += 1

    def count(self, op: str | None = None, device: str | None = None, replica: int | None | EllipsisType = ...) -> int:
        """Operations recorded; only `op` (``"aten::mm"``), only on `device` (``"cuda:0"``), only of
        `replica` (its id in the sync group; None: outside `strategy.run`) when given."""
        with self._lock:
            return sum(
                n
                for (o, d, r), n in self._ops.items()
                if op in (None, o) and device in (None, d) and (replica is ... or replica == r)
            )

    def summary(self, top: int = 10) -> PlacementSummary:
        """The short report: operations per device and replica, copies (per step and bytes), and the
        `top` operations that ran most often off their replica's device (e.g. on the CPU for a GPU replica)."""
        if isinstance(top, bool) or not isinstance(top, int) or top < 1:
            raise InputError(
                f"summary(top=) is how many off-device operations to list, at least 1. Received: top={top!r}."
            )
        with self._lock:
            return summarize(
                Counter(self._ops),
                Counter(self._copies),
                Counter(self._copy_bytes),
                Counter(self._off_device),
                self._steps,
                top,
            )

    # ---- called by the dispatch mode ----------------------------------------------------------
    def _record(
        self,
        op: str,
        device: str,
        replica: _Replica | None,
        copy: fallback.Copy | None,
        reason: str | None = None,
        fallback_from: torch.device | None = None,
    ) -> None:
        expected = replica.device if replica is not None else self.device
        if expected is None:
            expected = fallback_from  # a soft-placed operation left its inputs' device, replica or not
        off = copy is None and expected is not None and device != "no tensors" and not _same_device(device, expected)
        with self._lock:
            self._ops[op, device, None if replica is None else replica.replica] += 1
            if copy is not None:
                self._copies[copy.source, copy.destination, reason] += 1
                self._copy_bytes[copy.source, copy.destination, reason] += copy.num_bytes
            if off:
                self._off_device[op, device, str(expected), reason] += 1

    def _record_copies(self, copies: list[fallback.Copy], reason: str) -> None:
        with self._lock:
            for copy in copies:
                self._copies[copy.source, copy.destination, reason] += 1
                self._copy_bytes[copy.source, copy.destination, reason] += copy.num_bytes


def log_placement(device: str | torch.device | None = None) -> PlacementLog:
    """A placement log for the code inside ``with``: operations per device, copies, off-device operations.

    Args:
        device: where code outside `strategy.run` is meant to run (for a plain PyTorch loop);
            inside `strategy.run` each replica's own device is used.

    Example:
        >>> with sg.log_placement() as log:
        ...     for x, y in dataset:
        ...         strategy.run(train_step, args=(x, y))
        >>> print(log.summary())
        >>> json.dumps(log.summary().to_dict())
    """
    if device is not None and not isinstance(device, torch.device):
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise InputError(
                f"log_placement(device=) takes a torch device name. Received: device={device!r}. "
                "Use e.g. 'cuda:0' or 'cpu', or leave it out inside strategy.run."
            ) from None
    return PlacementLog(device)


@contextlib.contextmanager
def soft_placement() -> Iterator[fallback.SoftPlacement]:
    """Runs operations that have no kernel on their inputs' device on the CPU instead.

    Their inputs are copied to the CPU, arguments they mutate are written back, and their outputs
    are copied to the original device; backward passes through them work when the operation has
    an autograd formula. Each one is counted by the object this yields, logged once as a warning,
    and recorded (with its copies and the reason) in every open placement log. It applies to the
    replica threads of `strategy.run` and to torch's autograd threads too.
    Without it such an operation raises `PlacementError`.

    Example:
        >>> with sg.soft_placement() as soft, sg.log_placement() as log:
        ...     strategy.run(train_step, args=(x, y))    # a CPU-only custom op on a GPU replica
        >>> soft.count()
        2
    """
    region = fallback.SoftPlacement()
    with _join(soft=(region,)):
        yield region


# ---- threads ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CapturedPlacement:
    """The placement logs and soft-placement regions active on the thread that captured them."""

    logs: tuple[PlacementLog, ...]
    soft: tuple[fallback.SoftPlacement, ...]
    replica: int | None
    """The replica the capturing thread ran (None outside `strategy.run`)."""


def capture_placement() -> CapturedPlacement | None:
    """What this thread logs and soft-places, to hand to threads doing its work; None when nothing is active.

    Example (a strategy's worker threads):
        >>> captured = capture_placement()                          # on the thread that hands out the work
        >>> with apply_placement(captured, device=stage_device):    # on the worker thread
        ...     run_stage()
    """
    mode = getattr(_thread, "mode", None)
    if mode is None or not (mode.logs or mode.soft):
        return None
    return CapturedPlacement(mode.logs, mode.soft, None if mode.replica is None else mode.replica.replica)


def apply_placement(
    captured: CapturedPlacement | None, device: torch.device | None = None
) -> contextlib.AbstractContextManager:
    """On another thread, logs and soft-places as the thread that called `capture_placement()` did.

    With `device` (a pipeline stage's device), this thread's operations count for the capturing
    thread's replica and are judged against `device`; without it, against the replica context this
    thread enters itself (as replica threads do). ``apply_placement(None)`` enters nothing.
    """
    if captured is None:
        return contextlib.nullcontext()
    if not isinstance(captured, CapturedPlacement):
        raise InputError(
            "apply_placement() takes what capture_placement() returned. "
            f"Received: {type(captured).__name__}. Call capture_placement() on the thread that starts the work."
        )
    if device is None:
        return _join(logs=captured.logs, soft=captured.soft)
    if not isinstance(device, torch.device):
        raise InputError(
            f"apply_placement(device=) takes a torch.device. Received: {device!r}. Use e.g. torch.device('cuda', 1)."
        )
    return _join(logs=captured.logs, soft=captured.soft, replica=_Replica(captured.replica, device))


def note_replica(replica: int | None, device: torch.device | None = None) -> None:
    """Tells the placement log which replica this thread runs from now on (None: none).

    `enter_replica` calls it; a strategy that sets replica contexts another way should too.
    Entering replica 0 starts a step in every log active on this thread.
    """
    current = None if replica is None else _Replica(replica, device)
    _thread.replica = current
    mode = getattr(_thread, "mode", None)
    if mode is None:
        return
    mode.replica = current
    if replica == 0:
        for log in mode.logs:
            log.step()


@contextlib.contextmanager
def _join(
    logs: tuple[PlacementLog, ...] = (), soft: tuple[fallback.SoftPlacement, ...] = (), replica: _Replica | None = None
) -> Iterator[None]:
    """Adds logs and soft-placement regions to this thread's placement mode, entering one if it has none.

    One mode per thread, whatever the nesting: its handler records into every open log, so
    nested logs each see their region, and a soft-placement fallback's copies reach all of them.
    """
    mode: _PlacementMode | None = getattr(_thread, "mode", None)
    if mode is not None:
        saved = mode.logs, mode.soft, mode.replica
        mode.logs, mode.soft = mode.logs + logs, mode.soft + soft
        mode.replica = replica or mode.replica
        try:
            yield
        finally:
            mode.logs, mode.soft, mode.replica = saved
        return
    mode = _PlacementMode(replica or getattr(_thread, "replica", None))
    mode.logs, mode.soft = logs, soft
    _thread.mode = mode
    try:
        # torch keeps a process-wide "in a dispatch mode" flag that each __enter__ saves and each
        # __exit__ restores; replica threads enter and leave their modes while the caller's is active,
        # so the flag they restore is the caller's and stays right.
        with mode:
            yield
    finally:
        _thread.mode = None


class _PlacementMode(TorchDispatchMode):
    """Sees every operation of its thread (and of torch's autograd threads working for it)."""

    def __init__(self, replica: _Replica | None) -> None:
        super().__init__()
        self.logs: tuple[PlacementLog, ...] = ()
        self.soft: tuple[fallback.SoftPlacement, ...] = ()
        # The replica of the thread that entered the mode. Read from the mode, not the thread, because
        # torch's autograd threads run this mode's handler while that thread waits in backward().
        self.replica = replica

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        logs, regions, replica = self.logs, self.soft, self.replica
        tensors = _tensors(args, kwargs.values())

        placed: list[str] = []

        def on_fallback(op: str, device: torch.device, copies: list[fallback.Copy]) -> None:
            placed.append(op)
            why = fallback.reason(op, str(device))
            for log in logs:
                log._record(op, "cpu", replica, None, why, fallback_from=device)
                log._record_copies(copies, "soft placement")

        out = fallback.call_or_fall_back(func, args, kwargs, tensors, regions, on_fallback)
        if logs and not placed and func.namespace != "profiler":  # record_function markers are not work
            op = func._schema.name
            device = _op_device(tensors, out)
            copy = _copy_of(func, args, out)
            for log in logs:
                log._record(op, device, replica, copy)
        return out


def _op_device(inputs: list[torch.Tensor], out: Any) -> str:
    """Where an operation ran: its first tensor input's device, skipping CPU scalars (torch lets a
    0-dim CPU tensor join a GPU operation), else its output's (factories)."""
    for t in inputs:
        device = t.device
        if device.type != "cpu" or t.dim() != 0:
            return str(device)
    if inputs:
        return str(inputs[0].device)
    outputs = _tensors(out if isinstance(out, (tuple, list)) else (out,))
    return str(outputs[0].device) if outputs else "no tensors"


def _tensors(*groups: Any) -> list[torch.Tensor]:
    """The tensors among operator arguments: plain, or in a tensor list (an aten schema nests no deeper).
    Cheaper than a pytree walk, and this runs for every operation."""
    found: list[torch.Tensor] = []
    for group in groups:
        for value in group:
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, (list, tuple)):
                found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _copy_of(func: Any, args: tuple, out: Any) -> fallback.Copy | None:
    """The copy between devices this operation makes, if it is one."""
    packet = func.overloadpacket
    if packet is _aten._to_copy:
        source, destination = args[0], out
    elif packet in (_aten.copy_, _aten.copy):
        destination, source = args[0], args[1]
    elif packet in (_aten._copy_from, _aten._copy_from_and_resize):
        source, destination = args[0], args[1]
    elif packet is _aten._local_scalar_dense:
        # .item() and friends: one element read back to the host (and a synchronisation on a GPU).
        source = args[0]
        if source.device.type == "cpu":
            return None
        return fallback.Copy(str(source.device), "cpu", source.element_size())
    else:
        return None
    if not isinstance(source, torch.Tensor) or not isinstance(destination, torch.Tensor):
        return None
    if source.device == destination.device:
        return None
    return fallback.Copy(str(source.device), str(destination.device), fallback.nbytes(source))


@functools.lru_cache(maxsize=256)
def _same_device(device: str, expected: torch.device) -> bool:
    ran = torch.device(device)
    if ran.type != expected.type:
        return False
    return ran.index is None or expected.index is None or ran.index == expected.index
