"""The model that `ShardedStrategy.distribute` and `ModelParallelStrategy.distribute` hand back.

The strategy builds one module that runs the computation (FSDP2's sharded copy, the user's model with its
placed modules, or the pipeline of an `nn.Sequential`) and hands it back behind `WrappedModel`, so that a
script written for DDP or FSDP reaches it as `model.module`, as it does under every data-parallel strategy
(`data_parallel.distributed.DistributedModel`). Every other use goes to that module: calling it runs its own
hooks (FSDP2's gathers, the placement's moves), `parameters()` and `state_dict()` are its own with the same
names, and an attribute the wrapper does not have (`set_requires_gradient_sync`, a submodule, a user's
method) is the module's. Nothing is set on the module. `torch.save(model)`, pickling and `copy.deepcopy` give the
module, or, where the strategy says why a copy would not be the model (`copy_refused`), an `InputError` saying so.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any, ContextManager, SupportsIndex

import torch
from torch import nn

from stratagem.errors import InputError
from stratagem.strategies.data_parallel.outside_changes import refuse_new_parameters


class WrappedModel(nn.Module):
    """One module, reached as `.module`, to which every call and attribute goes.

    Example:
        >>> model, optimizer = strategy.distribute(Net(), torch.optim.AdamW(...))
        >>> model(x)                     # the sharded (or placed) module's forward, with its hooks
        >>> model.module                 # that module, as DDP's and FSDP1's `.module`
        >>> model.state_dict().keys()    # the module's own names (no "module." prefix)
    """

    def __init__(
        self,
        module: nn.Module,
        kind: str,
        *,
        copy_refused: str | None = None,
        plain: nn.Module | None = None,
        apply_in: Callable[[], ContextManager[Any]] | None = None,
    ) -> None:
        super().__init__()
        # Not registered as a sub-module: names stay the module's own (state_dict, named_parameters, checkpoints).
        object.__setattr__(self, "_wrapped", module)
        object.__setattr__(self, "_kind", kind)
        object.__setattr__(self, "_copy_refused", copy_refused)
        # What a pickle or copy of the model is: the user's own module (a pipeline's nn.Sequential), by default the
        # module that runs.
        object.__setattr__(self, "_plain", module if plain is None else plain)
        # Where `apply(fn)` runs: ShardedStrategy's scope(), in which a random init draws each parameter whole as one
        # device would (on the shards alone each rank would draw from its own generator).
        object.__setattr__(self, "_apply_in", apply_in if apply_in is not None else contextlib.nullcontext)
        object.__setattr__(self, "training", module.training)

    @property
    def module(self) -> nn.Module:
        """The module that runs the computation (the sharded copy, the placed model or the pipeline)."""
        return self._wrapped

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrapped(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self._wrapped.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self._wrapped.named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self._wrapped.buffers(recurse)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return self._wrapped.named_buffers(*args, **kwargs)

    def children(self) -> Iterator[nn.Module]:
        return self._wrapped.children()

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        return self._wrapped.named_children()

    def modules(self, *args: Any, **kwargs: Any) -> Iterator[nn.Module]:
        return self._wrapped.modules(*args, **kwargs)

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        return self._wrapped.named_modules(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]  # every overload
        return self._wrapped.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self._wrapped.load_state_dict(state_dict, strict=strict, assign=assign)

    def train(self, mode: bool = True) -> WrappedModel:
        self._wrapped.train(mode)
        object.__setattr__(self, "training", mode)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._wrapped.zero_grad(set_to_none)

    def apply(self, fn: Callable[[nn.Module], None]) -> WrappedModel:  # type: ignore[override]
        # The module and every submodule, as on one device (nn.Module.apply would call fn on this wrapper).
        with self._apply_in():
            self._wrapped.apply(fn)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> WrappedModel:
        # .to(), .double(), .cuda(): whatever the module itself does with them (a pipeline refuses a move).
        self._wrapped._apply(fn, recurse)
        return self

    def to(self, *args: Any, **kwargs: Any) -> WrappedModel:  # type: ignore[override]
        self._wrapped.to(*args, **kwargs)
        return self

    # Changes made outside the step go to the module, as on one device (`model.use_aux = False` reaches its forward).
    def __setattr__(self, name: str, value: Any) -> None:
        refuse_new_parameters(self._wrapped, name, value)
        setattr(self._wrapped, name, value)
        if name == "training":
            object.__setattr__(self, "training", value)

    def __delattr__(self, name: str) -> None:
        delattr(self._wrapped, name)

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        self._wrapped.register_buffer(name, tensor, persistent)

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        refuse_new_parameters(self._wrapped, name, param)
        self._wrapped.register_parameter(name, param)

    def add_module(self, name: str, module: nn.Module | None) -> None:
        refuse_new_parameters(self._wrapped, name, module)
        self._wrapped.add_module(name, module)

    def register_module(self, name: str, module: nn.Module | None) -> None:
        self.add_module(name, module)

    def __getattr__(self, name: str) -> Any:
        if name in ("_wrapped", "_kind", "_copy_refused", "_plain", "_apply_in"):
            raise AttributeError(name)
        return getattr(self._wrapped, name)

    def __getitem__(self, index: Any) -> Any:
        # Looked up on the class, so __getattr__ never sees it: `model[0]` of an nn.Sequential works as on one device.
        return self._wrapped[index]  # type: ignore[index]

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105
        # The user's module's class, as under the data-parallel strategies (DistributedModel.__class__): pickle
        # writes the plain module's own NEWOBJ reduction only where `obj.__class__` is its class.
        if "_plain" not in self.__dict__:
            return type(self)
        return type(self._plain)

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        # torch.save(model), pickle.dumps(model) and copy.deepcopy(model) give the plain module's own pickle, as under
        # the data-parallel strategies; refused up front where a copy would not be the model (ShardedStrategy's
        # shards, placed modules whose hooks move tensors between devices).
        if self._copy_refused is not None:
            raise InputError(self._copy_refused)
        return self._plain.__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # Defined here, or __getattr__ would hand copy.deepcopy the module's own (FSDP2's raw AssertionError).
        if self._copy_refused is not None:
            raise InputError(self._copy_refused)
        return copy.deepcopy(self._plain, memo)

    def __repr__(self) -> str:
        return f"{self._kind}(module={self._wrapped!r})"
