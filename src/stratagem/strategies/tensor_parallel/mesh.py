"""`DeviceMesh` and `LayoutMap`: where each parameter lives, in Keras 3's words (`keras.distribution`).

Plain data, checked before any process group exists (as torchtitan's `ParallelDims` is): a layout's axes
against the mesh, a layout's length against its tensor, and tied parameters against each other. `DeviceMesh`
itself (shape, axis names, the product against the worker count) is the worker group's, defined in
`stratagem.cluster.mesh` and re-exported here. Nothing here imports torch.distributed; `apply.py` turns the
resolved layouts into DTensor placements.

Example:
    >>> mesh = DeviceMesh((2,), ("model",))
    >>> layout_map = LayoutMap(mesh)
    >>> layout_map[r"mlp\\.c_fc\\.weight"] = (None, "model")
    >>> layout_map["transformer.h.0.mlp.c_fc.weight"], layout_map["transformer.h.0.ln_1.weight"]
    ((None, 'model'), None)
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from stratagem.cluster.mesh import DeviceMesh, one_axis_mesh
from stratagem.errors import InputError

__all__ = [
    "DeviceMesh",
    "Layout",
    "LayoutMap",
    "MODEL_AXIS",
    "ParameterLayout",
    "check_axes",
    "default_mesh",
    "resolve_layouts",
]

Layout = tuple[str | None, ...]
"""One mesh axis name, or None (not split), per dimension of a parameter tensor."""


MODEL_AXIS = "model"
"""The axis that splits layers: a layout map with no mesh has one axis of this name over every worker."""


def default_mesh(world_size: int) -> DeviceMesh:
    """One `model` axis over every worker: what `TensorParallelStrategy` uses when the layout map has no mesh."""
    return one_axis_mesh(world_size, MODEL_AXIS)


class LayoutMap:
    """Regular expressions over parameter names, each to a layout (Keras 3's `keras.distribution.LayoutMap`).

    A key is a regular expression searched (`re.search`) in a name of `model.named_parameters()`; an exact key
    wins, else the first key in insertion order that matches. A value is a tuple with one mesh axis name or
    None per dimension of the parameter (a `Linear.weight` is ``(out, in)``: ``("model", None)`` splits its
    output features; transformers' `Conv1D.weight` is ``(in, out)``). A parameter no key matches is replicated.

    Example:
        >>> layout_map = LayoutMap(DeviceMesh((2,), ("model",)))
        >>> layout_map[r"c_fc\\.weight"] = (None, "model")
        >>> layout_map[r"c_fc\\.bias"] = ("model",)
        >>> layout_map["h.1.mlp.c_fc.bias"]
        ('model',)
    """

    def __init__(self, mesh: DeviceMesh | None = None) -> None:
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise InputError(
                f"A LayoutMap's mesh is a stratagem DeviceMesh. Received: {type(mesh).__name__}. "
                "Give sg.DeviceMesh(shape, axis_names), or None for one 'model' axis over every worker."
            )
        self.mesh = mesh
        self._layouts: dict[str, Layout] = {}

    def __setitem__(self, key: str, layout: Sequence[str | None]) -> None:
        if not isinstance(key, str):
            raise InputError(f"A layout map's key is a regular expression (a str). Received: {key!r}.")
        try:
            re.compile(key)
        except re.error as error:
            raise InputError(f"A layout map's key is not a regular expression. Received: {key!r} ({error}).") from None
        if not isinstance(layout, (tuple, list)) or any(a is not None and not isinstance(a, str) for a in layout):
            raise InputError(
                f"A layout is a tuple with one mesh axis name or None per dimension. Received: {key!r} -> {layout!r}. "
                "Give e.g. (None, 'model')."
            )
        layout = tuple(layout)
        named = [a for a in layout if a is not None]
        if len(set(named)) != len(named):
            raise InputError(
                f"A layout names each mesh axis at most once. Received: {key!r} -> {layout}. "
                "Split one dimension per axis."
            )
        if self.mesh is not None:
            check_axes(key, layout, self.mesh)
        self._layouts[key] = layout

    def __getitem__(self, name: str) -> Layout | None:
        """The layout of the parameter `name`: its exact key, else the first key that matches, else None."""
        return self.match(name)[1]

    def match(self, name: str) -> tuple[str | None, Layout | None]:
        """(the key that gave `name` its layout, the layout); (None, None) where no key matches."""
        if name in self._layouts:
            return name, self._layouts[name]
        for key, layout in self._layouts.items():
            if re.search(key, name):
                return key, layout
        return None, None

    def __delitem__(self, key: str) -> None:
        del self._layouts[key]

    def __contains__(self, key: object) -> bool:
        return key in self._layouts

    def __iter__(self) -> Iterator[str]:
        return iter(self._layouts)

    def __len__(self) -> int:
        return len(self._layouts)

    def __repr__(self) -> str:
        return f"LayoutMap(mesh={self.mesh!r}, {self._layouts!r})"


def check_axes(key: str, layout: Layout, mesh: DeviceMesh) -> None:
    """Refuses a layout that names an axis the mesh does not have."""
    unknown = [a for a in layout if a is not None and a not in mesh.axis_names]
    if unknown:
        raise InputError(
            f"The layout of {key!r} names axis {unknown[0]!r}, which the mesh does not have. Received: {key!r} -> "
            f"{layout}, mesh axes {mesh.axis_names}. Use one of {mesh.axis_names} or None."
        )


@dataclass(frozen=True)
class ParameterLayout:
    """One parameter's resolved layout: its names (several where it is tied), shape, and the key that matched."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    layout: Layout
    key: str | None
    """The layout map's key that gave the layout (None: no key matched, so replicated)."""

    @property
    def is_split(self) -> bool:
        return any(a is not None for a in self.layout)


def resolve_layouts(
    layout_map: LayoutMap, mesh: DeviceMesh, parameters: Iterable[tuple[str, object, tuple[int, ...]]]
) -> list[ParameterLayout]:
    """Each distinct parameter's layout, checked: its axes in the mesh, one entry per dimension, tied names alike.

    `parameters` yields ``(name, identity, shape)`` for every name of every parameter, tied ones under each of
    their names (`named_parameters(remove_duplicate=False)`); names of one identity are one tensor. A tied name
    that no key matches follows the names that are matched.
    """
    by_identity: dict[int, list[tuple[str, tuple[int, ...], str | None, Layout | None]]] = {}
    for name, identity, shape in parameters:
        key, layout = layout_map.match(name)
        by_identity.setdefault(id(identity), []).append((name, tuple(shape), key, layout))
    resolved = []
    for entries in by_identity.values():
        matched = [(name, key, layout) for name, _, key, layout in entries if layout is not None]
        distinct = {layout for _, _, layout in matched}
        if len(distinct) > 1:
            (a, ka, la), (b, kb, lb) = next(
                (x, y) for i, x in enumerate(matched) for y in matched[i + 1 :] if x[2] != y[2]
            )
            raise InputError(
                f"{a} and {b} are one tied parameter but have different layouts. Received: {a} -> {la} (key {ka!r}), "
                f"{b} -> {lb} (key {kb!r}). Give both the same layout (one key that matches both, e.g. "
                f"{'|'.join(re.escape(n) for n in (a, b))!r})."
            )
        name, shape = entries[0][0], entries[0][1]
        key, layout = (matched[0][1], matched[0][2]) if matched else (None, (None,) * len(shape))
        if len(layout) != len(shape):
            raise InputError(
                f"The layout of {name} has {len(layout)} entries but the parameter has {len(shape)} dimensions. "
                f"Received: {key!r} -> {layout}, shape {shape}. Give one mesh axis or None per dimension."
            )
        check_axes(key or name, layout, mesh)
        resolved.append(ParameterLayout(tuple(n for n, *_ in entries), shape, layout, key))
    return resolved
