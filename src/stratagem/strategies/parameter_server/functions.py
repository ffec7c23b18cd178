"""How a scheduled function and its arguments reach a worker, without pickle.

Every task runs the same script, so a function travels as its name: ``{"module", "qualname"}``,
resolved in the worker's own copy of the script (``__main__`` is the script on every task). A
function that has no such name (a lambda, a closure, a method of a local object) can only run
on workers that live in the chief's own process (the in-process test cluster): it travels as a
number in a table of this process, together with this process's random id, so a worker in
another process refuses it by name instead of running something else.

Arguments and results are structures of tensors (sent as raw bytes), ``None``, booleans,
numbers, strings, lists, tuples and dicts with string keys, and per-worker iterators (sent as a
reference to the worker's own iterator). Anything else is refused when ``schedule`` is called.

An error raised by a scheduled function comes back as its type's name, message and traceback; the
chief raises the same type when it is a built-in exception or a class of a module it has already
imported (and that can be built from a message), else a ``ReplicaError`` naming the type.
"""

from __future__ import annotations

import builtins
import itertools
import math
import secrets
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from stratagem.errors import InputError, ParameterServerError, ReplicaError

PROCESS_ID = secrets.token_hex(8)
_local_functions: dict[int, Callable[..., Any]] = {}
_local_lock = threading.Lock()
_counter = itertools.count()


def _named(fn: Callable[..., Any]) -> dict[str, str] | None:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        return None
    target: Any = sys.modules.get(module)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return {"module": module, "qualname": qualname} if target is fn else None


def function_ref(fn: Callable[..., Any], *, local_ok: bool) -> dict[str, Any]:
    """How ``fn`` travels: by name, or (``local_ok``: only workers in this process) by a local number."""
    if not callable(fn):
        raise InputError(
            f"Only functions can be scheduled. Received: {fn!r:.80}. Pass a function defined at module level."
        )
    named = _named(fn)
    if named is not None:
        return named
    if not local_ok:
        raise InputError(
            f"A function sent to workers in other processes needs a module-level name. Received: "
            f"{getattr(fn, '__qualname__', fn)!r} from module {getattr(fn, '__module__', None)!r}. Define it with "
            "`def` at the top level of the script (every task runs the same script and finds it by name)."
        )
    with _local_lock:
        number = next(_counter)
        _local_functions[number] = fn
    return {"process": PROCESS_ID, "local": number}


def resolve_function(ref: Any) -> Callable[..., Any]:
    """The function a ``function_ref`` names, in this process."""
    if isinstance(ref, dict) and set(ref) == {"process", "local"}:
        if ref["process"] != PROCESS_ID or ref["local"] not in _local_functions:
            raise ParameterServerError(
                f"This worker cannot run a function defined inside another function of another process. Received: "
                f"local function {ref['local']!r} of process {ref['process']!r}. Define it at module level."
            )
        return _local_functions[ref["local"]]
    if not (
        isinstance(ref, dict)
        and set(ref) == {"module", "qualname"}
        and isinstance(ref["module"], str)
        and isinstance(ref["qualname"], str)
    ):
        raise ParameterServerError(
            f"Malformed function reference. Received: {ref!r:.120}. "
            "Schedule functions through ClusterCoordinator.schedule."
        )
    target: Any = sys.modules.get(ref["module"])
    if target is None:
        raise ParameterServerError(
            f"Module {ref['module']!r} is not loaded on this worker. Received: {ref['module']}.{ref['qualname']}. "
            "Run the same script on every task, importing the module that defines the function."
        )
    for part in ref["qualname"].split("."):
        target = getattr(target, part, None)
    if not callable(target):
        raise ParameterServerError(
            f"No function {ref['module']}.{ref['qualname']} on this worker. Received: {target!r:.80}. Define it "
            "at module level before the script first calls coordinator.schedule (workers start serving there)."
        )
    return target


# ---- structures of values -----------------------------------------------------------------------
class Encoder:
    """Turns a structure into JSON plus named tensors; ``refs`` turns special objects into JSON."""

    def __init__(self, refs: Callable[[Any], Any] | None = None) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._refs = refs

    def encode(self, value: Any, where: str = "value") -> Any:
        if isinstance(value, torch.Tensor):
            key = str(len(self.tensors))
            self.tensors[key] = value.detach()
            return {"$t": key}
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            if not math.isfinite(value):
                return {"$f": repr(value)}
            return value
        if isinstance(value, list):
            return [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {"$tuple": [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            # Any mapping (a Hugging Face BatchEncoding, a UserDict) travels as its items and arrives as a dict:
            # its class need not be importable, let alone trusted, on the other side.
            return {"$dict": {k: self.encode(v, f"{where}[{k!r}]") for k, v in value.items()}}
        if self._refs is not None:
            ref = self._refs(value)
            if ref is not None:
                return ref
        raise InputError(
            f"This value cannot travel between tasks. Received: {where} of type {type(value).__name__}. Use "
            "tensors, numbers, strings, None, lists, tuples, dicts with string keys, or per-worker iterators."
        )


def decode(tree: Any, tensors: dict[str, torch.Tensor], refs: Callable[[dict[str, Any]], Any] | None = None) -> Any:
    """The structure ``Encoder.encode`` described; ``refs`` resolves special references."""
    if isinstance(tree, list):
        return [decode(v, tensors, refs) for v in tree]
    if isinstance(tree, dict):
        if set(tree) == {"$t"}:
            return tensors[tree["$t"]]
        if set(tree) == {"$f"}:
            return float(tree["$f"])
        if set(tree) == {"$tuple"}:
            return tuple(decode(v, tensors, refs) for v in tree["$tuple"])
        if set(tree) == {"$dict"}:
            return {k: decode(v, tensors, refs) for k, v in tree["$dict"].items()}
        if refs is not None:
            return refs(tree)
        raise ParameterServerError(
            f"Unknown reference in a message. Received: {tree!r:.120}. Send values built by the coordinator."
        )
    return tree


# ---- errors ---------------------------------------------------------------------------------------
def describe_error(exc: BaseException) -> dict[str, str]:
    """An exception as JSON: its type's module and name, and its message."""
    return {"module": type(exc).__module__, "type": type(exc).__qualname__, "message": str(exc)}


def rebuild_error(info: dict[str, Any], where: str) -> Exception:
    """The chief-side exception for a worker's error ``info``; ``where`` says which function on which worker."""
    module = sys.modules.get(info.get("module", ""))
    cls: Any = builtins if info.get("module") == "builtins" else module
    for part in str(info.get("type", "")).split("."):
        cls = getattr(cls, part, None)
    note = f"raised by {where}"
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            exc = cls(info.get("message", ""))
        except Exception:  # noqa: BLE001 - a class that needs other arguments falls back to ReplicaError
            exc = None
        if exc is not None and hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(f"{note}\n{info.get('traceback', '')}".rstrip())
            return exc
    error = ReplicaError(
        f"A scheduled function failed: {note}. Received: {info.get('module')}.{info.get('type')}: "
        f"{info.get('message')}. See the worker's traceback below.\n{info.get('traceback', '')}"
    )
    return error
