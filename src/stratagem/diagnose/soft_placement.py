"""Soft placement: an operation with no kernel on its device runs on the CPU instead.

torch answers an operation that has no kernel for its inputs' device with a
``NotImplementedError`` ("Could not run 'ns::op' with arguments from the 'CUDA' backend").
Inside ``with sg.soft_placement():`` the operation runs on the CPU instead: its inputs are
copied to the CPU, the CPU kernel runs, arguments it mutates are written back and its outputs
are copied to the original device. Every such operation is counted by the region, logged once
as a warning, and recorded (with its copies and the reason) in the placement logs that are
open. Outside the mode the same operation raises a `PlacementError` that names it, the device
and the fix. The dispatch mode that calls these functions lives in `placement.py`.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from stratagem.errors import PlacementError

logger = logging.getLogger(__name__)

CPU = torch.device("cpu")

_NO_KERNEL = re.compile(r"Could not run '(?P<op>[^']+)' with arguments from the '(?P<backend>[^']+)' backend")


@dataclass(frozen=True)
class MissingKernel:
    """What torch could not run: the operation, and the device (or backend) it had no kernel for."""

    op: str
    """The operation in torch's spelling, ``"aten::mul"`` or ``"mylib::my_op"``."""
    where: str
    """The device of the inputs (``"cuda:0"``), or torch's backend name when no tensor is at hand (``"CUDA"``)."""
    torch_message: str
    """torch's sentence: "Could not run 'ns::op' with arguments from the 'X' backend."."""


def missing_kernel(error: BaseException, tensors: Sequence[torch.Tensor] = ()) -> MissingKernel | None:
    """The missing kernel `error` reports, or None when it reports something else.

    `tensors` are the operation's tensor inputs: the first one not on the CPU names the device
    (an operation whose inputs are all on the CPU lacks a CPU kernel, which soft placement cannot fix).
    """
    if not isinstance(error, NotImplementedError) or isinstance(error, PlacementError):
        return None
    text = str(error)
    match = _NO_KERNEL.search(text)
    if match is None:
        return None
    where = match.group("backend")
    if where.endswith("CPU"):  # CPU, SparseCPU, QuantizedCPU...: the CPU is where soft placement would run it
        return None
    if tensors:
        off_cpu = [t.device for t in tensors if t.device.type != "cpu"]
        if not off_cpu:
            return None
        where = str(off_cpu[0])
    # torch goes on with its build advice and every backend the op has; the first sentence is the fact.
    return MissingKernel(op=match.group("op"), where=where, torch_message=match.group(0) + ".")


def placement_error(missing: MissingKernel) -> PlacementError:
    """The error raised for an operation with no kernel on its device when soft placement is off."""
    return PlacementError(
        f"Operation {missing.op} has no kernel for {missing.where} (torch: {missing.torch_message}). "
        f"Received: inputs on {missing.where}. Register a kernel for that device (torch.library), move the "
        "inputs to a device that has one, or run the code inside `with sg.soft_placement():` to run such "
        "operations on the CPU with their inputs and outputs copied (each one is recorded in sg.log_placement())."
    )


def as_placement_error(error: BaseException) -> PlacementError | None:
    """torch's missing-kernel error turned into a `PlacementError` with the fix; None for any other error."""
    missing = missing_kernel(error)
    return None if missing is None else placement_error(missing)


@dataclass(frozen=True)
class Copy:
    """One tensor moved between devices."""

    source: str
    destination: str
    num_bytes: int


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes a copy of `tensor` moves: its elements times their size (its storage may be larger)."""
    return tensor.numel() * tensor.element_size()


def run_on_cpu(func: Any, args: tuple, kwargs: dict, device: torch.device) -> tuple[Any, list[Copy]]:
    """Runs the aten/custom operation `func` on the CPU for inputs on `device`.

    Returns its outputs, moved to `device`, and the copies made. Must be called where the
    dispatch mode is not active (inside `__torch_dispatch__`), so the copies run as plain copies.
    Outputs come back as new tensors: an output that was a view of an input is a copy here.
    """
    copies: list[Copy] = []
    cpu_of: dict[int, torch.Tensor] = {}  # id(original) -> its CPU copy
    original_of: dict[int, torch.Tensor] = {}  # id(CPU copy) -> the original

    def to_cpu(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.device.type == "cpu":
            return value
        if id(value) in cpu_of:
            return cpu_of[id(value)]
        moved = value.to(CPU)
        copies.append(Copy(str(value.device), "cpu", nbytes(value)))
        cpu_of[id(value)] = moved
        original_of[id(moved)] = value
        return moved

    cpu_args, cpu_kwargs = pytree.tree_map(to_cpu, (args, kwargs))
    out = func(*cpu_args, **cpu_kwargs)
    for original in _mutated_arguments(func, args, kwargs):
        if id(original) in cpu_of:
            original.copy_(cpu_of[id(original)])
            copies.append(Copy("cpu", str(original.device), nbytes(original)))

    def back(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) in original_of:
            return original_of[id(value)]  # an in-place op returned its input, written back above
        moved = value.to(device)
        copies.append(Copy("cpu", str(device), nbytes(value)))
        return moved

    return pytree.tree_map(back, out), copies


def _mutated_arguments(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors the operation writes to, from its schema (``Tensor(a!)``)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    mutated: list[torch.Tensor] = []
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        mutated.extend(v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor))
    return mutated


class SoftPlacement:
    """What one ``with sg.soft_placement():`` region ran on the CPU instead of its device.

    Example:
        >>> with sg.soft_placement() as soft:
        ...     strategy.run(train_step, args=(x, y))
        >>> soft.count("mylib::my_op")        # how many times it ran on the CPU instead
        4
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()
        self._entered = False

    def _record(self, op: str, device: str) -> None:
        with self._lock:
            first = (op, device) not in self._counts
            self._counts[op, device] += 1
        if first:
            # Never silent: the first fallback of each operation is logged even when no placement log is open.
            logger.warning(
                "%s has no kernel for %s; it ran on the CPU with its inputs and outputs copied (soft placement).",
                op,
                device,
            )

    def count(self, op: str | None = None, device: str | None = None) -> int:
        """How many operations ran on the CPU instead (of `op`, from `device`, when given)."""
        with self._lock:
            return sum(n for (o, d), n in self._counts.items() if op in (None, o) and device in (None, d))

    @property
    def operations(self) -> dict[tuple[str, str], int]:
        """``{(op, device it had no kernel for): count}``."""
        with self._lock:
            return dict(self._counts)


def reason(op: str, device: str) -> str:
    """The reason recorded in the placement log for a soft-placed operation."""
    return f"soft placement: {op} has no kernel for {device}"


def call_or_fall_back(
    func: Any,
    args: tuple,
    kwargs: dict,
    tensors: Sequence[torch.Tensor],
    soft: Sequence[SoftPlacement],
    on_fallback: Callable[[str, torch.device, list[Copy]], None],
) -> Any:
    """Calls `func`; when it has no kernel for its inputs' device, runs it on the CPU if `soft`
    regions are open (reporting it to them and to `on_fallback`) or raises `PlacementError`."""
    try:
        return func(*args, **kwargs)
    except NotImplementedError as error:
        missing = missing_kernel(error, tensors)
        if missing is None:
            raise
        if not soft:
            raise placement_error(missing) from error
        device = torch.device(missing.where)  # missing_kernel named the first input off the CPU
        op = func._schema.name
        try:
            out, copies = run_on_cpu(func, args, kwargs, device)
        except Exception as cpu_error:
            if hasattr(cpu_error, "add_note"):  # Python 3.11+
                cpu_error.add_note(f"(soft placement ran {op} on the CPU because it has no kernel for {device})")
            raise
        for region in soft:
            region._record(op, str(device))
        on_fallback(op, device, copies)
        return out
