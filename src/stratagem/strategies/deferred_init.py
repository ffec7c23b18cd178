"""Deferred initialization: a model constructed on the meta device, each tensor's value computed later, alone.

Inside `recording()` factories make meta tensors (shapes, no memory), and a dispatch mode writes down every
operation that makes or writes one: the `empty` of `nn.Linear`, the `uniform_` of its `reset_parameters`, a
`normal_` from a model-level `apply(init_fn)`, a `copy_` from another tensor, a `.to(torch.float64)`.
`InitRecord.materialize(tensor)` then computes one tensor's value on the CPU, exactly as the same constructor
run on one device computed it, by running only the operations that value depends on, in their order
(torchdistx's `deferred_init` records the same way, with fake tensors).

Random draws: on meta nothing is drawn, so the CPU generator would not advance and every later draw would
differ from one device's. Each random operation is therefore also run when it is recorded, on a CPU scratch
tensor of the same shape, dtype and strides, and freed at once: torch's CPU generator fills a tensor serially,
so what it draws depends only on its state and on that geometry, and the scratch advances it exactly as one
device's construction did. The state before the draw (`torch.get_rng_state()`, 5 KB) is kept, and the replay
restores it before running the operation on the real tensor. Recording thus holds one tensor at a time.

What cannot be replayed is refused by name: a value read from a tensor that does not exist yet (`.item()`), a
random draw whose parameters are such tensors, an operation that writes several recorded tensors at once, and a
meta tensor made where the recorder could not see it (refused when its value is asked for).
"""

from __future__ import annotations

import contextlib
import sys
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from stratagem.errors import InputError

_META = torch.device("meta")
_CPU = torch.device("cpu")
# Constructors that read Python data: torch makes their meta tensor without an operation a dispatch mode sees.
_FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray)
# Initializers that return at once for a meta tensor (`if tensor.is_meta: return tensor`), so that no operation is
# dispatched; each fills the whole tensor from the generator alone (trunc_normal_ redraws until inside its bounds).
_SKIP_META: dict[types.CodeType, Callable[..., Any]] = {
    f.__code__: f
    for f in (torch.nn.init.trunc_normal_, torch.nn.init.orthogonal_, torch.nn.init.dirac_, torch.nn.init.sparse_)
}


@dataclass(eq=False)
class _Node:
    """One meta storage made while recording, and the operations that wrote it, in order (the first made it)."""

    storage: torch.UntypedStorage
    """Kept alive, so that its address is never reused for another storage while the record lives."""
    ops: list[_Op] = field(default_factory=list)
    refusal: str | None = None
    """Why its value cannot be replayed (None: it can)."""


@dataclass(frozen=True, eq=False)
class _Ref:
    """A tensor read or written by a recorded operation: a view of a node's storage as it was then."""

    node: _Node | None
    """None: a meta tensor made outside the record."""
    version: int
    """How many of the node's operations had run when it was read."""
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass(frozen=True, eq=False)
class _Op:
    func: Callable[..., Any]
    """An aten operation, or one of the initializers of `_SKIP_META`."""
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    """With each meta tensor a `_Ref`, each real tensor a copy taken then, the meta device the CPU."""
    rng_state: torch.Tensor | None
    """The state, before a random operation, of the generator it draws from (None: it draws nothing). A
    `torch.Generator` the operation was given is replaced in `args` and `kwargs` by `_GIVEN`."""
    output: int | None
    """For the operation that made a node: which of its flattened outputs the node is (None: it writes in place)."""


class InitRecord:
    """What a construction did to the tensors it made on meta; `materialize` replays one tensor's value.

    Example:
        >>> with recording() as record:
        ...     layer = nn.Linear(4, 3)                      # meta: no memory, no draw
        >>> weight = record.materialize(layer.weight)        # on the CPU, the values nn.Linear(4, 3) would get
    """

    def __init__(self) -> None:
        self._nodes: dict[int, _Node] = {}

    def materialize(self, tensor: torch.Tensor, name: str = "the tensor") -> torch.Tensor:
        """The value `tensor` (a meta tensor made inside the record, or a view of one) has on one device, on the
        CPU; the CPU generator's state is left as it was. `name` is said in a refusal."""
        if not tensor.is_meta:
            return tensor
        ref = self._ref(tensor)
        saved = torch.get_rng_state()
        try:
            return self._value(ref, {}, name)
        finally:
            torch.set_rng_state(saved)

    # ---- recording --------------------------------------------------------------------------------
    def _ref(self, t: torch.Tensor) -> _Ref:
        node = self._nodes.get(t.untyped_storage()._cdata)
        version = len(node.ops) if node else 0
        return _Ref(node, version, tuple(t.size()), tuple(t.stride()), int(t.storage_offset()), t.dtype)

    def _record(self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        leaves = pytree.tree_leaves((args, kwargs))
        metas = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_meta]
        if not metas and kwargs.get("device") != _META:
            return func(*args, **kwargs)  # a real operation (on the CPU, say): it is what it is on one device
        if func is torch.ops.aten._local_scalar_dense.default:
            raise InputError(
                "Inside strategy.scope() a model's tensors have no values until their unit is built, so a value "
                f"cannot be read from one. Received: .item() (or a Python number) of a tensor of shape "
                f"{tuple(metas[0].shape)}. Read values after the scope, or compute them from Python numbers."
            )
        written = _written(func, args, kwargs)
        state = None
        if torch.Tag.nondeterministic_seeded in func.tags:
            read = [t for t in metas if not any(t is w for w in written)]
            if read:
                raise InputError(
                    f"{func} draws random numbers whose parameters are tensors made inside strategy.scope(), which "
                    f"have no values yet, so the draw cannot be repeated exactly. Received: {len(read)} such "
                    "tensor(s). Draw with Python numbers as parameters (normal_(mean, std)), or build the model "
                    "outside scope()."
                )
            state = _generator_state((args, kwargs))
            _advance(func, args, kwargs)
        inputs = {t.untyped_storage()._cdata for t in metas}
        refs = pytree.tree_map(self._arg, (args, kwargs))
        out = func(*args, **kwargs)
        nodes = [self._nodes[k] for k in {w.untyped_storage()._cdata for w in written if w.is_meta} if k in self._nodes]
        for node in nodes:
            if len(nodes) > 1:
                node.refusal = f"{func} wrote it together with {len(nodes) - 1} other tensor(s) at once"
            node.ops.append(_Op(func, refs[0], refs[1], state, None))
        for index, o in enumerate(pytree.tree_leaves(out)):
            if isinstance(o, torch.Tensor) and o.is_meta:
                key = o.untyped_storage()._cdata
                if key not in inputs and key not in self._nodes:  # a new storage, not a view of an input
                    made_args, made_kwargs = refs
                    if "dtype" in _argument_names(func) and made_kwargs.get("dtype") is None:
                        made_kwargs = {**made_kwargs, "dtype": o.dtype}  # the default dtype of the moment
                    node = _Node(o.untyped_storage())
                    node.ops.append(_Op(func, made_args, made_kwargs, state, index))
                    self._nodes[key] = node
        return out

    def _initializer(self, func: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        """A call of one of `_SKIP_META` on a recorded tensor, which dispatches nothing: run on a CPU scratch tensor
        (the generator advances as on one device) and recorded whole."""
        tensor = kwargs["tensor"]
        if not (isinstance(tensor, torch.Tensor) and tensor.is_meta):
            return
        node = self._nodes.get(tensor.untyped_storage()._cdata)
        state = _generator_state(kwargs)
        refs = pytree.tree_map(self._arg, kwargs)
        scratch = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=_CPU)
        with torch._C.DisableTorchFunction():  # the scratch's own temporaries stay on the CPU
            func(**{**kwargs, "tensor": scratch})
        if node is not None:
            node.ops.append(_Op(func, (), refs, state, None))

    def _arg(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._ref(value) if value.is_meta else value.detach().clone()
        if isinstance(value, torch.Generator):
            return _GIVEN
        return _CPU if isinstance(value, torch.device) and value == _META else value

    # ---- replay -----------------------------------------------------------------------------------
    def _value(self, ref: _Ref, cache: dict[tuple[int, int], torch.UntypedStorage], name: str) -> torch.Tensor:
        if ref.node is None:
            raise InputError(
                f"The value of {name} cannot be replayed: it is computed from a meta tensor made where "
                "strategy.scope() could not see it (before the scope, or by a path that bypasses torch's "
                f"operations). Received: a meta tensor of shape {ref.size}. Make it inside the scope with torch's "
                "factories (torch.empty, torch.zeros, torch.tensor), or build the model outside scope()."
            )
        if ref.node.refusal is not None:
            raise InputError(
                f"The value of {name} cannot be replayed one tensor at a time: {ref.node.refusal}. Received: a "
                f"tensor of shape {ref.size}. Initialize it with operations that write it alone, or build the model "
                "outside scope()."
            )
        storage = self._storage(ref.node, ref.version, cache, name)
        return torch.empty(0, dtype=ref.dtype).set_(storage, ref.offset, ref.size, ref.stride)

    def _storage(
        self, node: _Node, version: int, cache: dict[tuple[int, int], torch.UntypedStorage], name: str
    ) -> torch.UntypedStorage:
        key = (id(node), version)
        if key in cache:
            return cache[key]
        storage: torch.UntypedStorage | None = None
        for op in node.ops[:version]:

            def resolve(value: Any) -> Any:
                if value is _GIVEN:  # a generator of the user's own, as it was before the draw
                    return torch.Generator().set_state(typing.cast(torch.Tensor, op.rng_state))
                if not isinstance(value, _Ref):
                    return value
                if value.node is node:  # the node itself, as far as it has been replayed
                    mine = typing.cast(torch.UntypedStorage, storage)
                    return torch.empty(0, dtype=value.dtype).set_(mine, value.offset, value.size, value.stride)
                return self._value(value, cache, name)

            args, kwargs = pytree.tree_map(resolve, (op.args, op.kwargs), is_leaf=lambda v: isinstance(v, _Ref))
            if op.rng_state is not None and not any(v is _GIVEN for v in pytree.tree_leaves((op.args, op.kwargs))):
                torch.set_rng_state(op.rng_state)
            out = op.func(*args, **kwargs)
            if op.output is not None:
                storage = pytree.tree_leaves(out)[op.output].untyped_storage()
        assert storage is not None, "a node's first operation makes it"
        cache[key] = storage
        return storage


class _Recorder(TorchDispatchMode):
    def __init__(self, record: InitRecord) -> None:
        super().__init__()
        self._record_ = record

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        return self._record_._record(func, args, dict(kwargs or {}))


class _FromData(TorchFunctionMode):
    """`torch.tensor(data)` and its kin made on the CPU, then copied to meta where the recorder sees the copy."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _FROM_DATA and kwargs.get("device") in (None, "meta", _META):
            made = func(*args, **{**kwargs, "device": _CPU})
            # An empty tensor holds no values, so it stays on the CPU: transformers asks `torch.tensor([]).device`
            # whether it is building on meta, and then skips every weight's initialization.
            return made if made.numel() == 0 else made.to(_META)
        return func(*args, **kwargs)


@contextlib.contextmanager
def recording() -> Iterator[InitRecord]:
    """Tensors made inside are meta; the operations that make and write them are recorded for `materialize`."""
    record = InitRecord()

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        func = _SKIP_META.get(frame.f_code) if event == "call" else None
        if func is not None:
            code = frame.f_code
            names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
            record._initializer(func, {name: frame.f_locals[name] for name in names})

    previous = sys.getprofile()
    sys.setprofile(profile)  # this thread's calls only: a construction runs on the thread that entered
    try:
        with torch.device(_META), _FromData(), _Recorder(record):
            yield record
    finally:
        sys.setprofile(previous)


class _Given:
    """Stands, in a recorded operation, for the `torch.Generator` it was given (replayed from its saved state)."""


_GIVEN = _Given()


def _generator_state(args: Any) -> torch.Tensor:
    """The state of the generator a random operation draws from: the one it was given, else the CPU's default."""
    given = [g for g in pytree.tree_leaves(args) if isinstance(g, torch.Generator)]
    return given[0].get_state() if given else torch.get_rng_state()


def _written(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an operation writes, by its schema (`Tensor(a!)`)."""
    out: list[torch.Tensor] = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = kwargs.get(argument.name) if argument.name in kwargs else (args[i] if i < len(args) else None)
        out.extend(t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))
    return out


def _argument_names(func: torch._ops.OpOverload) -> set[str]:
    return {argument.name for argument in func._schema.arguments}


def _advance(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The random operation run on CPU scratch tensors of the meta ones' geometry: the generator advances as the
    same draw on one device advances it."""

    def scratch(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_meta:
            return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=_CPU)
        return _CPU if isinstance(value, torch.device) and value == _META else value

    scratch_args, scratch_kwargs = pytree.tree_map(scratch, (args, kwargs))
    func(*scratch_args, **scratch_kwargs)
