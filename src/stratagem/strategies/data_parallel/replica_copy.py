"""The copy of a model that each replica but the first runs (`copy_replica`).

`copy.deepcopy` copies a module's registered submodules, plain attributes and bound methods through one
memo, so a plain attribute that refers to a submodule, or a bound method of one (`self.f = self.mlp.forward`),
refers to the copy's submodule. It does not copy functions: a `lambda` or nested function kept as an attribute
(minGPT's `self.mlpf = lambda x: m.c_proj(m.act(m.c_fc(x)))`) still closes over the original's submodules, so
every replica would call replica 0's. `copy_replica` rebuilds each such function of the copy with its closure
cells and default arguments mapped through the same memo (the original's submodules to the copy's), and
refuses, naming the attribute, what it cannot map: a function that reaches the original model through its
globals, and a module with parameters held by a plain attribute only (its parameters are not the model's, so
no strategy places them or keeps them equal across replicas).
"""

from __future__ import annotations

import copy
import types
from typing import Any

import torch
from torch import nn

from stratagem.errors import ReplicaError

_MODULE_TABLES = ("_parameters", "_buffers", "_modules")
_MAX_DEPTH = 8  # how deep a closure's contents are searched for a module of the model


def copy_replica(model: nn.Module) -> nn.Module:
    """A deep copy of `model` whose attributes, closures included, refer to the copy's own submodules."""
    memo: dict[int, Any] = {}
    clone = copy.deepcopy(model, memo)
    names = {id(module): name for name, module in model.named_modules()}
    _check_hidden_modules(model, names)
    made = {id(value) for value in memo.values()}
    remap = _Remap(memo, names, made)
    for name, module in clone.named_modules():
        for attribute, value in list(vars(module).items()):
            if attribute in _MODULE_TABLES:
                continue
            where = f"{name}.{attribute}" if name else attribute
            new = remap.value(value, where, 0)
            if new is not value:
                vars(module)[attribute] = new
    return clone


_ATOMS = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType, types.BuiltinFunctionType)


def copy_value(value: Any, source: nn.Module, target: nn.Module, where: str) -> Any:
    """`value`, newly set on `source` (or one of its submodules) after the replicas were made, as `target`, a
    replica of `source`, must hold it: the same object where it is immutable; else a copy through the same
    rules as `copy_replica`, in which `source`'s modules, parameters and buffers are `target`'s own, tensors
    are on `target`'s device, and functions that close over `source`'s submodules are rebuilt onto `target`'s.

    Raises `ReplicaError` naming `where` for a value that cannot be copied.
    """
    if isinstance(value, _ATOMS) or (isinstance(value, tuple) and all(isinstance(v, _ATOMS) for v in value)):
        return value
    memo: dict[int, Any] = {}
    names: dict[int, str] = {}
    for name, module in source.named_modules():
        mine = target.get_submodule(name) if name else target
        memo[id(module)] = mine
        names[id(module)] = name
        for table in ("_parameters", "_buffers"):
            for key, tensor in vars(module)[table].items():
                if tensor is not None:
                    memo[id(tensor)] = vars(mine)[table][key]
    if id(value) in memo:
        return memo[id(value)]
    device = next((t.device for t in (*target.parameters(), *target.buffers())), None)
    if isinstance(value, torch.Tensor):
        return value.detach().to(device or value.device, copy=True)
    known = set(memo)
    memo[id(memo)] = [value]  # keeps what the memo refers to alive, as deepcopy does with its own entries
    try:
        clone = copy.deepcopy(value, memo)
    except Exception as error:  # noqa: BLE001  # any failure of the value's own copy protocol is the user's to see
        raise ReplicaError(
            f"The attribute `{where}` was set on the distributed model after strategy.distribute(), and every "
            f"replica needs its own copy of it, but it cannot be copied: {type(error).__name__}: {error}. "
            f"Received: a {type(value).__name__}. Set it before distribute(), or make it copyable (copy.deepcopy)."
        ) from error
    made = {id(v) for k, v in memo.items() if k not in known and k != id(memo)}
    return _Remap(memo, names, made).value(clone, where, 0)


def _check_hidden_modules(model: nn.Module, names: dict[int, str]) -> None:
    """Refuses a module with parameters that a plain attribute holds but no module registers."""
    for name, module in model.named_modules():
        for attribute, value in vars(module).items():
            if attribute in _MODULE_TABLES or not isinstance(value, nn.Module) or id(value) in names:
                continue
            count = sum(p.numel() for p in value.parameters())
            if count:
                where = f"{name}.{attribute}" if name else attribute
                raise ReplicaError(
                    f"The model's attribute `{where}` holds a {type(value).__name__} with {count} parameter values "
                    "that is not registered as a submodule, so its parameters are not in model.parameters(): a "
                    "strategy can neither place them on each replica's device nor keep the replicas' copies equal. "
                    "Received: a module set past nn.Module's registration (object.__setattr__ or __dict__). Register "
                    f"it (`self.{attribute} = module`), or keep it outside the model and pass it to the step."
                )


class _Remap:
    """Maps the functions of a copied model onto the copy's submodules through deepcopy's memo."""

    def __init__(self, memo: dict[int, Any], names: dict[int, str], made: set[int]) -> None:
        self._memo = memo
        self._names = names  # id of each of the original's modules -> its qualified name
        self._made = made  # ids of the objects the copy made (the only ones changed in place)
        self._functions: dict[int, Any] = {}

    def value(self, value: Any, where: str, depth: int) -> Any:
        """`value` of the copy, with every function in it rebuilt onto the copy's submodules."""
        if depth > _MAX_DEPTH:
            return value
        if isinstance(value, types.FunctionType):
            return self.function(value, where)
        if isinstance(value, (list, dict)) and id(value) in self._made:
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in list(items):
                new = self.value(item, f"{where}[{key!r}]", depth + 1)
                if new is not item:
                    value[key] = new
            return value
        if isinstance(value, tuple) and id(value) in self._made:
            new_items = tuple(self.value(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))
            if any(a is not b for a, b in zip(new_items, value)):
                return type(value)(*new_items) if hasattr(value, "_fields") else type(value)(new_items)
        return value

    def function(self, fn: types.FunctionType, where: str) -> Any:
        if id(fn) in self._functions:
            return self._functions[id(fn)]
        self._functions[id(fn)] = fn  # a function that reaches itself
        self._refuse_globals(fn, where)
        cells = fn.__closure__ or ()
        contents = [_cell_value(cell) for cell in cells]
        new_contents = [self.mapped(item, where) for item in contents]
        defaults = fn.__defaults__ or ()
        new_defaults = tuple(self.mapped(item, where) for item in defaults)
        kwdefaults = fn.__kwdefaults__ or {}
        new_kwdefaults = {key: self.mapped(item, where) for key, item in kwdefaults.items()}
        unchanged = (
            all(a is b for a, b in zip(new_contents, contents))
            and all(a is b for a, b in zip(new_defaults, defaults))
            and all(new_kwdefaults[k] is v for k, v in kwdefaults.items())
        )
        if unchanged:
            return fn
        closure = tuple(types.CellType(item) if item is not _EMPTY else types.CellType() for item in new_contents)
        new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, new_defaults or None, closure or None)
        new.__kwdefaults__ = new_kwdefaults or None
        new.__dict__.update(fn.__dict__)
        new.__qualname__ = fn.__qualname__
        new.__doc__ = fn.__doc__
        self._functions[id(fn)] = new
        return new

    def mapped(self, item: Any, where: str) -> Any:
        """A closure's or default's content as the copy sees it: the copy of an object of the model, a function
        rebuilt, a deep copy (through the memo) of what reaches a module of the model; else the item itself."""
        if item is _EMPTY:
            return item
        if id(item) in self._memo and id(item) != id(self._memo):
            return self._memo[id(item)]
        if isinstance(item, types.FunctionType):
            return self.function(item, where)
        if _reaches(item, self._names, set(), 0):
            return copy.deepcopy(item, self._memo)
        return item

    def _refuse_globals(self, fn: types.FunctionType, where: str) -> None:
        for global_name in fn.__code__.co_names:
            if global_name not in fn.__globals__:
                continue
            found = _reaches(fn.__globals__[global_name], self._names, set(), 0)
            if found is not None:
                reached = f"the model's submodule `{self._names[found]}`" if self._names[found] else "the model itself"
                raise ReplicaError(
                    f"The model's attribute `{where}` is a function ({fn.__qualname__}) that reaches {reached} "
                    f"through the global `{global_name}`, so every replica copy "
                    "would call the original's submodule (replica 0's) instead of its own. Received: a function "
                    "whose globals hold the model. Define a method on the module instead (def forward_mlp(self, "
                    "x): ...), which each copy binds to itself."
                )


class _Empty:
    """Stands for an empty closure cell (a name assigned after the function was made)."""


_EMPTY = _Empty()


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY


def _reaches(value: Any, names: dict[int, str], seen: set[int], depth: int) -> int | None:
    """The id of a module of the original model that `value` holds (through containers, functions, bound
    methods and plain objects' attributes), or None."""
    if id(value) in names:
        return id(value)
    if depth > _MAX_DEPTH or id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type(None))):
        return None
    seen.add(id(value))
    if isinstance(value, nn.Module):
        return None  # another model's module: not this model's to map
    children: list[Any]
    if isinstance(value, dict):
        children = list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        children = list(value)
    elif isinstance(value, types.MethodType):
        children = [value.__self__, value.__func__]
    elif isinstance(value, types.FunctionType):
        children = [_cell_value(c) for c in value.__closure__ or ()] + list(value.__defaults__ or ())
    elif isinstance(value, type) or isinstance(value, types.ModuleType):
        return None
    else:
        children = list(getattr(value, "__dict__", {}).values())
    for child in children:
        found = _reaches(child, names, seen, depth + 1)
        if found is not None:
            return found
    return None
