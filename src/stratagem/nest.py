"""Nests: the batches and step results stratagem walks through, leaf by leaf.

A nest is a tensor (or any other leaf), or a tuple, list, named tuple, dataclass instance or
`Mapping` (a dict, an `OrderedDict`, a `UserDict` such as Hugging Face's `BatchEncoding`, a
dict-like dataclass such as its `ModelOutput`) of nests. Rebuilding a nest keeps its type: a
named tuple stays that named tuple, a `Mapping` subclass stays that class wherever it can be
built again from its items, a dataclass stays that dataclass (other attributes kept). A
`Mapping` whose class cannot be rebuilt from its items becomes a plain dict.

A nest whose leaves all come back unchanged is returned itself, not a copy, so a structure
holding no tensor (a configuration object, a list of strings) reaches every replica as the very
object the caller passed.

`torch.utils._pytree` covers tuples, lists and dicts but neither dataclasses nor arbitrary
`Mapping` classes unless each is registered up front, which a user's batch class never is.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

LeafPredicate = Callable[[Any], bool]


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def is_nest(value: Any, is_leaf: LeafPredicate | None = None) -> bool:
    """Whether `value` has children (a tuple, list, Mapping or dataclass instance) rather than being a leaf."""
    if is_leaf is not None and is_leaf(value):
        return False
    return isinstance(value, (tuple, list, Mapping)) or _is_dataclass_instance(value)


def children(value: Any) -> list[tuple[str, Any]]:
    """The children of a nest with the text that reaches each from its parent (`["key"]`, `[0]`, `.field`)."""
    if isinstance(value, Mapping):
        return [(f'["{key}"]' if isinstance(key, str) else f"[{key!r}]", value[key]) for key in value]
    if _is_namedtuple(value):
        return [(f".{name}", v) for name, v in zip(type(value)._fields, value)]
    if isinstance(value, (tuple, list)):
        return [(f"[{i}]", v) for i, v in enumerate(value)]
    return [(f".{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]


def rebuild(value: Any, new_children: list[Any]) -> Any:
    """`value`'s structure with `new_children`, in `children(value)`'s order, of `value`'s own type."""
    if isinstance(value, Mapping):
        return _rebuild_mapping(value, dict(zip(list(value), new_children)))
    if _is_namedtuple(value):
        return type(value)(*new_children)
    if isinstance(value, (tuple, list)):
        try:
            return type(value)(new_children)
        except TypeError:  # a subclass whose constructor takes other arguments
            return tuple(new_children) if isinstance(value, tuple) else list(new_children)
    out = copy.copy(value)  # keeps attributes that are not fields, and works for frozen dataclasses
    for f, child in zip(dataclasses.fields(value), new_children):
        object.__setattr__(out, f.name, child)
    return out


def _rebuild_mapping(value: Mapping, items: dict[Any, Any]) -> Mapping:
    kind: type[Any] = type(value)  # a Mapping subclass: its constructor takes what that class takes
    if kind is dict:
        return items
    if _is_dataclass_instance(value):
        # A dict-like dataclass (Hugging Face's ModelOutput): its constructor takes the fields by name.
        try:
            return kind(**items)
        except TypeError:
            pass
    try:
        return kind(items)  # dict and OrderedDict subclasses, UserDict (BatchEncoding takes its data first)
    except (TypeError, ValueError):
        pass
    if isinstance(value, MutableMapping):
        try:
            out = copy.copy(value)  # a defaultdict keeps its default_factory
            for key, child in items.items():
                out[key] = child
            return out
        except (TypeError, ValueError, AttributeError):
            pass
    return items


def map_structure(fn: Callable[[Any], Any], structure: Any, is_leaf: LeafPredicate | None = None) -> Any:
    """Applies `fn` to every leaf of a nest and rebuilds it (see the module docstring for what a nest is)."""
    if not is_nest(structure, is_leaf):
        return fn(structure)
    old = [child for _, child in children(structure)]
    new = [map_structure(fn, child, is_leaf) for child in old]
    if all(a is b for a, b in zip(old, new)):
        return structure
    return rebuild(structure, new)


def flatten(structure: Any, is_leaf: LeafPredicate | None = None) -> list[Any]:
    """The leaves of a nest, in order."""
    return [leaf for _, leaf in flatten_with_paths(structure, "", is_leaf)]


def flatten_with_paths(structure: Any, root: str = "", is_leaf: LeafPredicate | None = None) -> list[tuple[str, Any]]:
    """The leaves of a nest with their paths from `root`, e.g. `batch["labels"]`, `batch[0]`, `batch.mask`
    (a named tuple's and a dataclass's children are named by their fields)."""
    if not is_nest(structure, is_leaf):
        return [(root, structure)]
    out: list[tuple[str, Any]] = []
    for step, child in children(structure):
        out.extend(flatten_with_paths(child, root + step, is_leaf))
    return out
