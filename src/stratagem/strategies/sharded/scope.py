"""`strategy.scope()` under ShardedStrategy, TensorFlow's name and meaning: a model built inside is never whole.

    with strategy.scope():
        model = GPT2LMHeadModel(config)                    # meta tensors: no memory, no draw, every init recorded
    model, optimizer = strategy.distribute(model, torch.optim.AdamW(model.parameters()))

Inside the scope the model is built on the meta device and every operation that makes or writes its tensors is
recorded (`strategies/deferred_init.py`): `reset_parameters` in each layer's `__init__`, a model-level
`apply(init_fn)` (transformers' `post_init`, nanoGPT's `self.apply(self._init_weights)`), inside `__init__` or
after it, in the scope. When the scope closes, each model built in it is cut into units and sharded in place
(`fully_shard` on meta: each rank's shards, still empty), its shards are allocated (1/N of the parameters),
and then each parameter in turn is computed whole on the CPU by replaying the operations that made it, from
the generator states they drew with, its rows for this rank are copied into its shard, and the whole tensor is
freed. No rank ever holds more than its shards and one whole parameter (with what that parameter's
initialization reads), and each value is bit-identical to the same constructor run on one device with the same
seed. Buffers are whole on every rank, as FSDP2 keeps them.

A model sharded this way can be initialized again inside a later `with strategy.scope():` (`model.apply(init_fn)`
on its sharded parameters): each random draw that writes a sharded parameter is made whole, as one device
makes it, and this rank keeps its rows. Outside the scope torch's own DTensor draws apply, which on the CPU
draw each shard from the rank's own generator (torch warns), not one device's values.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from stratagem.errors import InputError
from stratagem.strategies.deferred_init import InitRecord, recording
from stratagem.strategies.sharded.units import UnitCut


@dataclass(frozen=True, eq=False)
class BuiltModel:
    """A model built inside the scope: sharded already, in place, with what `distribute` would have decided."""

    cut: UnitCut
    mapping: dict[int, nn.Parameter]
    """The id of each parameter as construction made it (an optimizer made inside the scope holds those) to the
    sharded parameter that replaced it."""
    model: weakref.ref[nn.Module]


@contextlib.contextmanager
def sharded_scope(
    shard: Callable[[nn.Module], UnitCut], device: torch.device, built: dict[int, BuiltModel]
) -> Iterator[None]:
    """Records the models built inside; at the end shards each in place (`shard` cuts it and applies
    `fully_shard` to its units) and fills its shards; `built` learns each one by id, for `distribute`."""
    roots = _Roots()
    with _ShardedDraws(), roots.watching(), recording() as record:
        yield
    for model in roots.models():
        if any(t.is_meta for t in _tensors(model)):
            built[id(model)] = _materialize(model, record, shard, device)


def _materialize(
    model: nn.Module, record: InitRecord, shard: Callable[[nn.Module], UnitCut], device: torch.device
) -> BuiltModel:
    from torch.distributed.tensor import DTensor

    layers = [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if layers:
        raise InputError(
            "ShardedStrategy's BatchNorm layers use the global batch's statistics, which a model built inside "
            f"strategy.scope() cannot be converted to yet. Received: BatchNorm layers {layers[:3]}. Build the "
            "model outside the scope and distribute it."
        )
    metas = {name: t for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]}
    metas = {name: t for name, t in metas.items() if t.is_meta}
    made = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    cut = shard(model)  # on meta: each rank's shards are made, empty
    # Only the tensors still on meta are allocated: one made on a real device inside the scope keeps its value.
    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)  # to_empty, less the real ones
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            meta = metas.get(name)
            if meta is None:
                continue
            whole = record.materialize(meta, f"'{name}'").to(device)
            if isinstance(tensor, DTensor):
                _copy_rows_(tensor, whole)
            else:
                tensor.copy_(whole)
            del whole  # the one whole tensor held at a time
    params = dict(model.named_parameters(remove_duplicate=False))
    mapping = {key: params[name] for key, name in made.items()}
    return BuiltModel(cut=cut, mapping=mapping, model=weakref.ref(model))


class _Roots:
    """The modules that received parameters, buffers or submodules while watching, less those that became
    another's submodule: the models built."""

    def __init__(self) -> None:
        self._owners: dict[int, weakref.ref[nn.Module]] = {}
        self._children: set[int] = set()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        from torch.nn.modules import module as module_hooks

        def owner(module: nn.Module, name: str, value: Any) -> None:
            self._owners.setdefault(id(module), weakref.ref(module))
            if isinstance(value, nn.Module):
                self._children.add(id(value))

        handles = [
            module_hooks.register_module_parameter_registration_hook(owner),
            module_hooks.register_module_buffer_registration_hook(owner),
            module_hooks.register_module_module_registration_hook(owner),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def models(self) -> list[nn.Module]:
        alive = [(key, ref()) for key, ref in self._owners.items()]
        return [m for key, m in alive if m is not None and key not in self._children]


class _ShardedDraws(TorchDispatchMode):
    """A random draw that writes a sharded parameter (`model.apply(init_fn)` on a model already sharded) made
    whole, from the CPU generator as one device makes it, and this rank's rows kept."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        kwargs = dict(kwargs or {})
        target = args[0] if args else None
        if not (
            isinstance(target, DTensor)
            and torch.Tag.nondeterministic_seeded in func.tags
            and func._schema.arguments[0].alias_info is not None
            and func._schema.arguments[0].alias_info.is_write
        ):
            return func(*args, **kwargs)
        others = [t for t in pytree.tree_leaves((args[1:], kwargs)) if isinstance(t, torch.Tensor)]
        if others:
            raise InputError(
                f"{func} on a sharded parameter draws with tensors as its parameters, which stratagem cannot draw "
                f"whole as one device would. Received: {len(others)} tensor argument(s). Pass Python numbers."
            )
        whole = torch.empty(target.shape, dtype=target.dtype, device="cpu")
        func(whole, *args[1:], **kwargs)  # the generator advances as one device's draw of the whole tensor
        _copy_rows_(target, whole.to(target.device))
        return target


def _copy_rows_(shard: Any, whole: torch.Tensor) -> None:
    """Copies into this rank's shard (a DTensor) its rows of `whole`, cut as `fully_shard` cut them: `torch.chunk`
    along the shard dimension of a 1-D mesh. No collective, and no copy of the whole tensor."""
    from torch.distributed.tensor import Shard, distribute_tensor

    local, mesh, placements = shard.to_local(), shard.device_mesh, shard.placements
    if mesh.ndim != 1 or not isinstance(placements[0], Shard):  # another layout: DTensor's own cut (a copy)
        local.copy_(distribute_tensor(whole, mesh, placements, src_data_rank=None).to_local())
        return
    dim = placements[0].dim
    rows = -(-whole.size(dim) // mesh.size())
    start = min(mesh.get_local_rank() * rows, whole.size(dim))
    local.copy_(whole.narrow(dim, start, local.size(dim)))


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()
