"""What a script does to a distributed model between steps reaches every replica (`OutsideChanges`).

Outside `Strategy.run` a distributed model is one model: its `.module`, replica 0 (the central copy under
CentralStorageStrategy). A script changes it as it would change one model: an attribute set or deleted on it
or on a submodule reached through it (`model.use_aux = False`, `model.head.dropout.p = 0.0`), `requires_grad_`
(a layer frozen for fine-tuning), `apply(init_fn)`, a submodule's `train()`/`eval()`, a buffer registered or
reassigned, values written in place under `torch.no_grad()`. The other replicas follow that module: at the
start of each run the replica set compares it with what it was when the last run ended (or at `distribute`)
and makes the same change on every other replica before any replica runs the step function.

What cannot be replayed is refused at that point, with the fix, before any replica computes with it: a
parameter added, removed, replaced, or given another dtype, device or shape after `distribute` (the
optimizer and the gradient combination hold the parameters they were given then), a parameter that was
frozen at `distribute` made trainable (its gradient is combined by no one), and a submodule with parameters
added after `distribute`.

The comparison is by identity and by tensors' version counters, never by value, so its cost per step is a walk
over the modules' attributes and parameters (`benchmarks/outside_changes.py` measures it).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stratagem.errors import InputError
from stratagem.strategies.data_parallel.replica_copy import copy_replica, copy_value

_MODULE_INTERNALS = frozenset(vars(nn.Module())) - {"training"}
"""The entries of every nn.Module's `__dict__` that are its tables and hooks, not attributes of the model
(`training` is an attribute here: a submodule's `eval()` must reach every replica)."""


@dataclass(frozen=True)
class _Tensor:
    """A parameter or buffer as it was at the snapshot: the object, and what says whether it changed since."""

    tensor: torch.Tensor | None
    version: int
    data_ptr: int
    requires_grad: bool
    kind: tuple[torch.dtype, torch.device, torch.Size] | None
    """dtype, device and shape at distribute: `_apply` (`.double()`) gives the same parameter object other data."""

    def written(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` (the same object) was written in place, or given other storage, since."""
        return tensor._version != self.version or tensor.data_ptr() != self.data_ptr


@dataclass(frozen=True)
class _ModuleState:
    attributes: dict[str, Any]
    parameters: dict[str, _Tensor]
    buffers: dict[str, _Tensor]
    persistent: frozenset[str]
    children: dict[str, nn.Module | None]


_VERSION = operator.attrgetter("_version")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _tensor_states(tensors: list[torch.Tensor]) -> list[tuple[int, int, bool]]:
    # map() over C getters: no Python frame per tensor (this runs every step).
    return list(zip(map(_VERSION, tensors), map(torch.Tensor.data_ptr, tensors), map(_REQUIRES_GRAD, tensors)))


def _tables(module: nn.Module) -> tuple[dict[str, Any], ...]:
    return vars(module), module._parameters, module._buffers, module._modules


class _Watched:
    """One distributed model: the module the script changes, and the replicas that follow it.

    A snapshot is shallow copies of each module's tables (its `__dict__`, parameters, buffers, children) and each
    tensor's version, storage and `requires_grad`. The check before a step compares those in C (dict equality
    takes identical values as equal without calling their `__eq__`); only where something differs does it look
    at what, module by module (`changes`). A run changes the tensors only (the optimizer writes in place), so
    the snapshot after a run takes the tensors' states again, not the tables.
    """

    def __init__(self, primary: nn.Module, followers: list[nn.Module]) -> None:
        self.primary = primary
        self.followers = followers
        # Parameters trainable at distribute: only their gradients are combined (ReplicaSet.replica_params).
        self.trainable = {id(p) for p in primary.parameters() if p.requires_grad}
        # What a parameter is at distribute: a replay never changes it (a change is refused).
        self.kinds = {id(p): (p.dtype, p.device, p.shape) for p in primary.parameters()}
        # Follower parameters that read the primary's storage (shared parameters, central storage's anchor).
        self.aliased = [
            {name for name, p in f.named_parameters() if p.data_ptr() == primary.get_parameter(name).data_ptr()}
            for f in followers
        ]
        self.modules: list[tuple[str, nn.Module]] = []
        self.tables: list[dict[str, Any]] = []  # each module's four tables, in order
        self.copies: list[dict[str, Any]] = []  # their copies at the snapshot
        self.tensors: list[torch.Tensor] = []
        self.tensor_states: list[tuple[int, int, bool]] = []
        self.names: dict[int, str] = {}  # id of each of the primary's modules at the snapshot -> its name
        self.snapshot()

    def snapshot(self) -> None:
        """The primary's modules, their tables and their tensors, as they are now."""
        self.modules = list(self.primary.named_modules())
        self.tables = [table for _, m in self.modules for table in _tables(m)]
        self.copies = [table.copy() for table in self.tables]
        self.tensors = [
            t for _, m in self.modules for t in (*m._parameters.values(), *m._buffers.values()) if t is not None
        ]
        self.names = {id(module): name for name, module in self.modules}
        self.snapshot_tensors()

    def snapshot_tensors(self) -> None:
        """The tensors' states as they are now (after a run, which wrote them)."""
        self.tensor_states = _tensor_states(self.tensors)

    def unchanged(self) -> bool:
        """Whether the primary is as it was at the snapshot (the check made before every step)."""
        try:
            if not all(map(operator.eq, self.tables, self.copies)):
                return False
        except (RuntimeError, TypeError, ValueError):  # a value replaced by another compared by value: a change
            return False
        return _tensor_states(self.tensors) == self.tensor_states

    def _old_state(self, index: int, module: nn.Module) -> _ModuleState:
        attributes, parameters, buffers, children = self.copies[4 * index : 4 * index + 4]
        states = {id(t): state for t, state in zip(self.tensors, self.tensor_states)}

        def old(tensor: torch.Tensor | None) -> _Tensor:
            if tensor is None:
                return _Tensor(None, 0, 0, False, None)
            return _Tensor(tensor, *states[id(tensor)], self.kinds.get(id(tensor)))

        return _ModuleState(
            attributes={k: v for k, v in attributes.items() if k not in _MODULE_INTERNALS},
            parameters={name: old(p) for name, p in parameters.items()},
            buffers={name: old(b) for name, b in buffers.items()},
            persistent=frozenset(buffers) - attributes["_non_persistent_buffers_set"],
            children=children,
        )

    def changes(self) -> list[Callable[[], None]]:
        """What makes every follower equal to the primary again; raises `InputError` for what cannot be replayed,
        before anything is changed."""
        actions: list[Callable[[], None]] = []
        if self.unchanged():
            return actions
        index = {name: i for i, (name, _) in enumerate(self.modules)}
        for name, module in self.primary.named_modules():
            if name not in index:
                continue  # inside a submodule added since: copied whole with it
            old = self._old_state(index[name], module)
            self._check_parameters(module, old, name, actions)
            self._check_buffers(module, old, name, actions)
            self._check_attributes(module, old, name, actions)
            self._check_children(module, old, name, actions)
        return actions

    def _counterparts(self, name: str) -> list[nn.Module]:
        return [f.get_submodule(name) if name else f for f in self.followers]

    def _check_parameters(
        self, module: nn.Module, old: _ModuleState, name: str, actions: list[Callable[[], None]]
    ) -> None:
        now = module._parameters
        for pname in _in_order(old.parameters, now):
            before = old.parameters.get(pname)
            p = now.get(pname)
            qualified = f"{name}.{pname}" if name else pname
            if before is None or p is not before.tensor:
                what = "added" if before is None else "removed" if p is None else "replaced by another tensor"
                raise _parameter_changed(qualified, what)
            if p is None or before.tensor is None:
                continue
            if (p.dtype, p.device, p.shape) != before.kind:
                raise InputError(
                    f"The parameter '{qualified}' of the distributed model changed to {p.dtype} {tuple(p.shape)} on "
                    f"{p.device} after strategy.distribute(), which placed and combined it as it was. Received: "
                    f"'{qualified}' now {p.dtype} {tuple(p.shape)} on {p.device}. Convert the model (model.double(), "
                    "model.half(), ...) before distribute(), or choose the devices with the strategy's devices=."
                )
            if p.requires_grad != before.requires_grad:
                if p.requires_grad and id(p) not in self.trainable:
                    raise InputError(
                        f"The parameter '{qualified}' was frozen (requires_grad=False) when the model was distributed "
                        "and has been made trainable since, but the strategy combines across replicas only the "
                        "gradients of parameters trainable at distribute(), so the replicas would drift apart. "
                        f"Received: '{qualified}'.requires_grad set to True after distribute(). Distribute the model "
                        "with it trainable and freeze it afterwards (requires_grad_(False) then True works), or "
                        "unfreeze it before distribute()."
                    )
                actions.append(_set_requires_grad(self._counterparts(name), pname, p.requires_grad))
            if before.written(p):
                actions.append(self._copy_parameter(name, pname, p))

    def _copy_parameter(self, name: str, pname: str, p: nn.Parameter) -> Callable[[], None]:
        qualified = f"{name}.{pname}" if name else pname

        def copy() -> None:
            with torch.no_grad():
                for aliased, follower in zip(self.aliased, self._counterparts(name)):
                    mine = follower._parameters[pname]
                    assert mine is not None, "a follower has the primary's parameters"
                    if qualified in aliased:
                        if mine.data_ptr() != p.data_ptr():
                            mine.data = p.data  # the primary was given new storage: read it too
                    else:
                        mine.copy_(p)

        return copy

    def _check_buffers(
        self, module: nn.Module, old: _ModuleState, name: str, actions: list[Callable[[], None]]
    ) -> None:
        now = module._buffers
        persistent = frozenset(now) - module._non_persistent_buffers_set
        for bname in _in_order(old.buffers, now):
            before = old.buffers.get(bname)
            b = now.get(bname)
            if bname not in now:
                actions.append(_delete(self._counterparts(name), bname))
            elif before is None or b is not before.tensor or (bname in persistent) != (bname in old.persistent):
                actions.append(_register_buffer(self._counterparts(name), bname, b, bname in persistent))
            elif b is not None and before.written(b):
                actions.append(_copy_buffer(self._counterparts(name), bname, b))

    def _check_attributes(
        self, module: nn.Module, old: _ModuleState, name: str, actions: list[Callable[[], None]]
    ) -> None:
        now = vars(module)
        for key in [k for k in old.attributes if k not in now]:
            actions.append(_delete(self._counterparts(name), key))
        for key, value in now.items():
            if key in _MODULE_INTERNALS or (key in old.attributes and old.attributes[key] is value):
                continue
            where = f"{name}.{key}" if name else key
            actions.append(self._set_attribute(name, key, value, where))

    def _set_attribute(self, name: str, key: str, value: Any, where: str) -> Callable[[], None]:
        def set_attribute() -> None:
            for follower in self.followers:
                counterpart = follower.get_submodule(name) if name else follower
                vars(counterpart)[key] = copy_value(value, self.primary, follower, where)

        return set_attribute

    def _check_children(
        self,
        module: nn.Module,
        old: _ModuleState,
        name: str,
        actions: list[Callable[[], None]],
    ) -> None:
        now = module._modules
        for cname in _in_order(old.children, now):
            child = now.get(cname)
            if cname in old.children and old.children[cname] is child:
                continue
            qualified = f"{name}.{cname}" if name else cname
            if cname not in now:
                actions.append(_delete(self._counterparts(name), cname))
                continue
            if child is not None and id(child) not in self.names:
                _refuse_module_with_parameters(qualified, child)
            actions.append(self._set_child(name, cname, child))

    def _set_child(self, name: str, cname: str, child: nn.Module | None) -> Callable[[], None]:
        names = dict(self.names)  # as they were before this replay: the followers' structure

        def set_child() -> None:
            for follower in self.followers:
                counterpart = follower.get_submodule(name) if name else follower
                if child is None:
                    mine = None
                elif id(child) in names:  # one of the model's own modules, moved or shared
                    mine = follower.get_submodule(names[id(child)]) if names[id(child)] else follower
                else:
                    mine = copy_replica(child).to(_device_of(follower))
                counterpart._modules[cname] = mine

        return set_child


def _in_order(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The names in either table, in registration order (a message names the first parameter changed)."""
    return [*before, *(name for name in now if name not in before)]


def _parameter_changed(qualified: str, what: str) -> InputError:
    return InputError(
        f"The parameter '{qualified}' of the distributed model was {what} after strategy.distribute(), so the "
        "optimizer and the gradient combination, which hold the parameters they were given, would no longer be one "
        f"device's. Received: parameter '{qualified}' {what}. Build the model completely before distribute(); to "
        f"change a parameter's values, write them in place under torch.no_grad() (model.{qualified}.copy_(...))."
    )


def _refuse_module_with_parameters(qualified: str, module: nn.Module) -> None:
    count = sum(p.numel() for p in module.parameters())
    if count:
        raise InputError(
            f"The submodule '{qualified}' was set on the distributed model after strategy.distribute() with {count} "
            "parameter values of its own, which no optimizer given to distribute() holds and no gradient combination "
            f"knows, so it could not train as on one device. Received: a {type(module).__name__} with parameters at "
            f"'{qualified}'. Build the model with it before distribute()."
        )


def refuse_new_parameters(module: nn.Module, name: str, value: Any) -> None:
    """Raises `InputError` where setting `value` as `name` on `module` (a distributed model's module, after
    `distribute`) would add or replace a parameter, or add a submodule with parameters of its own."""
    if isinstance(value, nn.Parameter) and module._parameters.get(name) is not value:
        raise _parameter_changed(name, "added" if name not in module._parameters else "replaced by another tensor")
    if isinstance(value, nn.Module) and all(value is not m for m in module.modules()):
        _refuse_module_with_parameters(name, value)


def _device_of(module: nn.Module) -> torch.device:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def _set_requires_grad(counterparts: list[nn.Module], pname: str, value: bool) -> Callable[[], None]:
    def set_requires_grad() -> None:
        for module in counterparts:
            mine = module._parameters[pname]
            if mine is not None:
                mine.requires_grad_(value)

    return set_requires_grad


def _delete(counterparts: list[nn.Module], key: str) -> Callable[[], None]:
    def delete() -> None:
        for module in counterparts:
            if hasattr(module, key):
                delattr(module, key)

    return delete


def _register_buffer(
    counterparts: list[nn.Module], bname: str, b: torch.Tensor | None, persistent: bool
) -> Callable[[], None]:
    def register() -> None:
        for module in counterparts:
            mine = None if b is None else b.detach().to(_device_of(module), copy=True)
            module._buffers.pop(bname, None)
            module.register_buffer(bname, mine, persistent=persistent)

    return register


def _copy_buffer(counterparts: list[nn.Module], bname: str, b: torch.Tensor) -> Callable[[], None]:
    def copy() -> None:
        with torch.no_grad():
            for module in counterparts:
                mine = module._buffers[bname]
                if mine is not None and mine is not b and mine.data_ptr() != b.data_ptr():
                    mine.copy_(b)

    return copy


class OutsideChanges:
    """Keeps every replica equal to the module a script changes between steps (see the module docstring).

    The replica set calls `watch` at each `distribute`, `replay` before the parts start a run, and `after_run`
    after they ended it.
    """

    def __init__(self) -> None:
        self._watched: list[_Watched] = []

    def watch(self, primary: nn.Module, replicas: list[nn.Module]) -> None:
        """Follows `primary`, the module a distributed model is outside a run, on every other of `replicas`."""
        self._watched.append(_Watched(primary, [r for r in replicas if r is not primary]))

    def replay(self) -> None:
        """Makes on every follower what was done to its primary since the last snapshot, or raises `InputError`
        (leaving every replica as it was) for what cannot be."""
        actions = [action for watched in self._watched for action in watched.changes()]
        for action in actions:
            action()
        if actions:
            for watched in self._watched:
                watched.snapshot()

    def after_run(self) -> None:
        """Remembers the primaries' tensors as the run left them."""
        for watched in self._watched:
            watched.snapshot_tensors()
