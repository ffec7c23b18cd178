"""How the user's optimizer reaches the parameter servers and is built again there.

The chief sends a spec: the optimizer's class (module and qualified name), each parameter group's
hyper-parameters, its ``defaults``, and the plain attributes the class's ``__init__`` set beside
those of ``torch.optim.Optimizer`` (a user's subclass keeps its own options there). All of it is
JSON; nothing is pickled. A server finds the class in a module it has already imported (the same
script runs on every task) and builds the optimizer over its shards.

Why the server does not call the class with the groups (``cls(param_groups)``): ``__init__``'s
signature is the class's own business. A user's subclass may need arguments that are not
hyper-parameters (the call fails), or take them with defaults and keep them as attributes (the call
succeeds with the wrong values, silently). So the server rebuilds the optimizer as unpickling does
(``torch.save``/``torch.load`` of an optimizer take this path too): ``cls.__new__`` and the class's own
``__setstate__`` with the chief's ``defaults`` and an empty state, then the chief's attributes, then
``add_param_group`` for each of the server's groups, which is all an optimizer keeps outside
``param_groups`` and ``state``.

    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> spec = optimizer_spec(torch.optim.AdamW([w], lr=0.1, weight_decay=0.5))
    >>> spec["defaults"]["weight_decay"], spec["defaults"]["decoupled_weight_decay"]
    (0.5, True)
    >>> rebuilt = build_optimizer(torch.optim.AdamW, [{"params": [w], **hypers_of(spec)[0]}], spec)
    >>> type(rebuilt).__name__, rebuilt.defaults["weight_decay"], rebuilt.param_groups[0]["lr"]
    ('AdamW', 0.5, 0.1)
"""

from __future__ import annotations

import functools
import sys
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from stratagem.errors import InputError, ParameterServerError, WireFormatError


@functools.cache
def base_attributes() -> frozenset[str]:
    """What torch.optim.Optimizer.__init__ sets on every instance: built again on the server, never sent."""
    # Found on first use, not at import: building an optimizer imports torch._dynamo (about 2.7 s of CPU).
    return frozenset(vars(torch.optim.Optimizer([torch.zeros(1, requires_grad=True)], {})))


def _plain(value: Any, where: str, what: str = "hyper-parameter") -> Any:
    """``value`` as JSON: a one-element tensor as its number, a tuple as ``{"tuple": [...]}``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, tuple):
        return {"tuple": [_plain(v, f"{where}[{i}]", what) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_plain(v, f"{where}[{i}]", what) for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v, f"{where}[{k!r}]", what) for k, v in value.items()}
    if not isinstance(value, (int, float, bool, str, type(None))):
        advice = (
            "Use numbers, booleans or tuples of them."
            if what == "hyper-parameter"
            else "Keep numbers, booleans, strings or tuples of them there: each server builds the optimizer "
            "again from these values."
        )
        raise InputError(
            f"An optimizer {what} cannot be sent to the parameter servers. Received: {where}={value!r:.80}. {advice}"
        )
    return value


def _from_plain(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"tuple"} and isinstance(value["tuple"], list):
        return tuple(_from_plain(v) for v in value["tuple"])
    if isinstance(value, dict):
        return {k: _from_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_plain(v) for v in value]
    return value


def optimizer_spec(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer as JSON: class path, each group's hyper-parameters, ``defaults`` and the attributes its
    class set (no parameters, no state); raises ``InputError`` for a value JSON cannot carry."""
    cls = type(optimizer)
    if isinstance(optimizer, torch.optim.LBFGS):
        raise InputError(
            "The parameter servers cannot apply LBFGS: its step re-evaluates the loss through a closure and "
            "searches along the whole parameter vector, while each server holds some shards and gets gradients "
            f"only. Received: {cls.__name__}. Choose a first-order optimizer (SGD, Adam, AdamW, ...), or train "
            "with LBFGS on one device (OneDeviceStrategy)."
        )
    groups = [
        {key: _plain(value, f"param_groups[{index}][{key!r}]") for key, value in group.items() if key != "params"}
        for index, group in enumerate(optimizer.param_groups)
    ]
    attributes = {}
    for name, value in vars(optimizer).items():
        if name in base_attributes() or (name == "step" and hasattr(value, "_wrapped_by_lr_sched")):
            continue  # rebuilt by Optimizer.__init__; an LR scheduler's wrapper calls the chief's optimizer
        attributes[name] = _plain(value, f"{cls.__name__}.{name}", "attribute")
    return {
        "module": cls.__module__,
        "qualname": cls.__qualname__,
        "groups": groups,
        "defaults": {key: _plain(value, f"defaults[{key!r}]") for key, value in optimizer.defaults.items()},
        "attributes": attributes,
    }


def hypers_of(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each parameter group's hyper-parameters from ``spec``, tuples restored."""
    return [_from_plain(hyper) for hyper in spec["groups"]]


def resolve_optimizer_class(module: str, qualname: str) -> type[torch.optim.Optimizer]:
    """The optimizer class named by ``module`` and ``qualname``; refuses anything else."""
    # Only modules this task has already imported: a message never makes a task import (run) new code.
    target: Any = sys.modules.get(module)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if target is None:
        raise ParameterServerError(
            f"Cannot find the optimizer class on this task. Received: {module}.{qualname}. "
            "Define it in a module every task imports (the same script runs everywhere)."
        )
    if not (isinstance(target, type) and issubclass(target, torch.optim.Optimizer)):
        raise ParameterServerError(
            f"Not a torch optimizer class. Received: {module}.{qualname}={target!r:.80}. Pass a torch.optim.Optimizer."
        )
    return target


def build_optimizer(
    cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]], spec: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """An instance of ``cls`` over ``groups`` with the ``defaults`` and attributes of ``spec``, made as unpickling
    makes one (see the module docstring); torch's foreach kernels where the user left the choice to torch (same
    arithmetic, one call over many shards instead of a Python loop)."""
    defaults, attributes = spec.get("defaults", {}), spec.get("attributes", {})
    if not (
        isinstance(defaults, dict)
        and isinstance(attributes, dict)
        and all(isinstance(k, str) and not k.startswith("__") and k not in base_attributes() for k in attributes)
    ):
        raise WireFormatError(
            f"An optimizer spec needs 'defaults' and 'attributes' objects of plain names. Received: "
            f"defaults={defaults!r:.80}, attributes={attributes!r:.80}. Send optimizer_spec(optimizer)."
        )
    if all(g.get("foreach", False) is None and not g.get("fused") and not g.get("differentiable") for g in groups):
        groups = [{**g, "foreach": True} for g in groups]  # every torch optimizer with the option has the kernels
    optimizer = cls.__new__(cls)
    optimizer.__setstate__({"defaults": _from_plain(defaults), "state": defaultdict(dict), "param_groups": []})
    # The class's own attributes before the groups: an add_param_group it overrides may read them.
    for name, value in _from_plain(attributes).items():
        setattr(optimizer, name, value)
    for group in groups:
        optimizer.add_param_group(group)
    return optimizer
