"""In-place changes to parameters that replicas share, made in the step function outside the optimizer.

Replicas that read one copy of the parameters (Mirrored's shared parameters on logical devices of one CPU,
CentralStorage's replicas that compute on the central device) each run the whole step function. An update
written by hand there (`p -= lr * p.grad` under `no_grad`, `torch._foreach_add_(params, grads)`) runs on
every replica and lands on the same memory: N updates per step instead of one. Without an optimizer the
replicas never share (each updates its own copy, which is exact); with one, such a change is refused, naming
the parameter, its shape and the fix, in two ways (`HandUpdateGuard`):

- Before it runs, in the first step a watch takes part in: every replica thread runs that step under a
  `TorchDispatchMode` (`_Refusal`) that looks at the arguments an ATen operator writes (in-place `self`, `out=`,
  a foreach operator's list) and raises when one IS a watched `nn.Parameter` object, so no replica has
  applied the change when the error reaches the caller (a view of a parameter is another tensor: the end of
  the step sees its change, below). The strategy's own writes are not seen:
  Mirrored's sharded optimizer writes views taken through `.data` (other tensor objects), and CentralStorage
  runs its update under `strategy_update`, which pauses the check on that thread. The mode costs one Python
  call per operator, so it runs for one step only.
- From then on, at the end of each step (`InPlaceWatch`): each replica parameter's version counter, which
  torch's in-place operations on that parameter advance and the strategy's own writes do not (or are
  subtracted, `written`), is compared with its value at the step's start. This catches a change that starts
  later in training, after it took effect.

Two mechanisms for one refusal because neither does both jobs: the dispatch mode refuses before any replica has
written (nothing to undo) but costs a Python call per operator, and the version counters cost nothing per
operator but see a change only once it has landed.

CentralStorage watches its compute copies too: a change there is overwritten by the central parameters at the
next step. Changes made through `p.data` touch another tensor object and move no counter of `p`, so neither
way sees them (a WGAN's `p.data.clamp_` on shared parameters is idempotent, and trains as on one device); the
`explain()` decision "parameter storage" says to update shared parameters only through the optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, ContextManager

import torch
from torch import nn
from torch.autograd.graph import increment_version
from torch.utils._python_dispatch import TorchDispatchMode

from stratagem.errors import InputError


class InPlaceWatch:
    """The parameters of the replicas that share storage, and what to say when one is changed in place.

    Args:
        replicas: (replica index, module) of every replica whose in-place changes would not count once.
        consequence: what such a change does, for the error.
        fix: what the user should do instead, for the error.
        counted: the replicas whose version counters are compared at the end of each step (default: all);
            leave out those whose parameters the strategy's own update writes in place (CentralStorage's
            anchor): only the check before a change sees them.

    The cost at the end of a step is two reads of a counter per counted parameter, as cheap as reading its `.grad`.
    """

    def __init__(
        self,
        replicas: Sequence[tuple[int, nn.Module]],
        consequence: str,
        fix: str,
        counted: Sequence[int] | None = None,
    ) -> None:
        self.watched = [(r, name, p) for r, module in replicas for name, p in module.named_parameters()]
        self._counted = [(r, name, p) for r, name, p in self.watched if counted is None or r in counted]
        self._params = [p for _, _, p in self._counted]
        self._consequence = consequence
        self._fix = fix
        self._before: list[int] = []
        self.checked = False
        """Whether a step ran its replicas under the check before a change (`HandUpdateGuard`) to the end."""

    def begin_step(self) -> None:
        # torch's count of in-place operations on each parameter (autograd's check that saved tensors are unchanged).
        self._before = [p._version for p in self._params]

    def written(self, params: Sequence[torch.Tensor]) -> None:
        """The strategy itself wrote `params` in place once each inside the step (CentralStorage refreshing its
        compute copies right after the update): those writes are not the user's."""
        if not self._before:
            return
        ids = {id(p) for p in params}
        self._before = [v + (id(p) in ids) for p, v in zip(self._params, self._before)]

    def end_step(self) -> None:
        """Raises `InputError` when a counted parameter was changed in place since `begin_step`."""
        before, self._before = self._before, []
        if not before:
            return
        now = [p._version for p in self._params]
        if now == before:
            return
        for (replica, name, p), old, new in zip(self._counted, before, now):
            if new != old:
                raise InputError(
                    f"Parameter {name!r} was changed in place inside the step function (replica {replica}: {new - old} "
                    "in-place operation(s)), outside the optimizer given to distribute(); seen at the end of the "
                    f"step, after the change took effect. {self._consequence} Received: an in-place change of "
                    f"{name!r} (shape {tuple(p.shape)}). {self._fix}"
                )

    def refusal(self, replica: int, name: str, p: nn.Parameter, op: str, stepped: bool) -> InputError:
        """The error for an in-place change of `p` by `op` on `replica`, refused before it ran."""
        update = (
            "with this step's optimizer update, which ran before it"
            if stepped
            else "and this step's optimizer update has not run"
        )
        return InputError(
            f"Parameter {name!r} was about to be changed in place inside the step function (replica {replica}: "
            f"{op}), outside the optimizer given to distribute(). {self._consequence} The change was refused before "
            f"it ran on any replica: the parameters hold their values from before it, {update}. Received: an "
            f"in-place change of {name!r} (shape {tuple(p.shape)}). {self._fix}"
        )


_written_arguments: dict[Any, list[tuple[int, str]]] = {}


def _written_positions(func: Any) -> list[tuple[int, str]]:
    """(position, name) of the arguments `func` writes: those marked `(a!)` in its schema (in-place `self`, `out=`,
    a foreach operator's list)."""
    positions = _written_arguments.get(func)
    if positions is None:
        arguments = func._schema.arguments
        positions = [(i, a.name) for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write]
        _written_arguments[func] = positions
    return positions


def _written_tensors(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors `func` writes."""
    for i, name in _written_positions(func):
        value = args[i] if i < len(args) else kwargs.get(name)
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(tensor, torch.Tensor):
                yield tensor


def run_keeping_versions(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`func(*args, **kwargs)` from a dispatch mode, with the version counters of a foreach operator's in-place
    list moved once, as outside any mode.

    Under a dispatch mode torch leaves those counters unchanged (a plain `add_` still moves its own); autograd's
    check of saved tensors and the watch at the end of a step both read them. Modes nest (the check before a
    change above a replica's random stream, replica_random.py), so a mode moves them only where none below did."""
    writes_first = _written_positions(func)[:1] == [(0, "self")]
    written = args[0] if writes_first and args and isinstance(args[0], (list, tuple)) else None
    if not written:
        return func(*args, **kwargs)
    before = written[0]._version
    out = func(*args, **kwargs)
    if written[0]._version == before:
        increment_version(written)
    return out


class _Refusal(TorchDispatchMode):
    """One replica thread's check before a change: raises instead of running an operator that writes a watched
    parameter, unless the strategy's own update is running on this thread."""

    # A higher-order operator (flex_attention, cond) reaches `__torch_dispatch__` instead of failing under the mode;
    # it runs as it is, unchecked (the watch at the end of the step still sees a change made inside it).
    supports_higher_order_operators = True

    def __init__(self, guard: HandUpdateGuard, replica: int) -> None:
        super().__init__()
        self._guard = guard
        self._replica = replica
        self.paused = False
        self.stepped = False  # the strategy's optimizer update ran on this replica in this step

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile skips a frame first called under a mode that does not say so, and never compiles it after
        # (torch 2.13): the model compiled by the user would run eagerly for good after this one step.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if not self.paused and func._schema.is_mutable:
            for tensor in _written_tensors(func, args, kwargs):
                found = self._guard.watched(tensor)
                if found is not None:
                    watch, name, p = found
                    raise watch.refusal(self._replica, name, p, str(func), self.stepped)
        return run_keeping_versions(func, args, kwargs)

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> Any:
        if exc_type is not None:
            self._guard.failed = True  # the step did not run to the end under the check: the next one checks again
        return super().__exit__(exc_type, exc_value, traceback)


class HandUpdateGuard:
    """The `InPlaceWatch`es of a replica builder, and each replica's check before a change (module docstring).

    The builder calls `begin_step` and `end_step` around each step, enters `around(replica)` on each replica's
    thread, and runs its own writes of watched parameters inside the step under `strategy_update(replica)`."""

    def __init__(self) -> None:
        self._watches: list[InPlaceWatch] = []
        self._by_id: dict[int, tuple[InPlaceWatch, str, nn.Parameter]] = {}
        self._modes: dict[int, _Refusal] = {}
        self._checking = False
        self.failed = False

    def add(self, watch: InPlaceWatch) -> None:
        self._watches.append(watch)
        for replica, name, p in watch.watched:
            self._by_id.setdefault(id(p), (watch, name, p))  # the watch holds `p`: its id is not reused
            self._modes.setdefault(replica, _Refusal(self, replica))

    def watched(self, tensor: torch.Tensor) -> tuple[InPlaceWatch, str, nn.Parameter] | None:
        """The watch, name and parameter that `tensor` is, or None (a view of a parameter is another tensor: its
        change moves the parameter's version counter, so the watch at the end of the step sees it)."""
        found = self._by_id.get(id(tensor))
        return found if found is not None and found[2] is tensor else None

    def begin_step(self) -> None:
        self._checking = any(not watch.checked for watch in self._watches)
        self.failed = False
        for mode in self._modes.values():
            mode.paused = False
            mode.stepped = False
        for watch in self._watches:
            watch.begin_step()

    def around(self, replica: int) -> ContextManager[Any]:
        """Where replica `replica`'s step runs: under its check before a change, in a watch's first step."""
        mode = self._modes.get(replica)
        return mode if mode is not None and self._checking else contextlib.nullcontext()

    @contextlib.contextmanager
    def strategy_update(self, replica: int) -> Iterator[None]:
        """The strategy's own update of the parameters on `replica`'s thread: not checked, and noted for the
        error of a change refused later in the step."""
        mode = self._modes.get(replica)
        if mode is None:
            yield
            return
        mode.paused = True
        try:
            yield
        finally:
            mode.paused = False
            mode.stepped = True

    def stepped(self, replica: int) -> None:
        """The strategy's optimizer update ran on `replica` (through views the check does not see)."""
        mode = self._modes.get(replica)
        if mode is not None:
            mode.stepped = True

    def written(self, params: Sequence[torch.Tensor]) -> None:
        for watch in self._watches:
            watch.written(params)

    def end_step(self) -> None:
        """Raises `InputError` when a watched parameter was changed in place in the step (`InPlaceWatch`)."""
        if self._checking and not self.failed:
            for watch in self._watches:
                watch.checked = True
        self._checking = False
        for watch in self._watches:
            watch.end_step()
