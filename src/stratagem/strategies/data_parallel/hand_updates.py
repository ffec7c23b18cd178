"""In-place changes to parameters that replicas share, made in the step function outside the optimizer.

Replicas that read one copy of the parameters (Mirrored's shared parameters on logical devices of one CPU,
CentralStorage's replicas that compute on the central device) each run the whole step function. An update
written by hand there (`p -= lr * p.grad` under `no_grad`, `torch._foreach_add_(params, grads)`) runs on
every replica and lands on the same memory: N updates per step instead of one. Without an optimizer the
replicas never share (each updates its own copy, which is exact); with one, `InPlaceWatch` reads each
replica parameter's version counter, which torch's in-place operations on that parameter advance and the
strategy's own optimizer (working on views taken through `.data`, or on the central parameters, which are
not watched) does not, and stops at the end of the first step that changed one, naming it. CentralStorage
watches its compute copies too: a change there is overwritten by the central parameters at the next step.
Changes made through `p.data` advance no counter of `p`; the `explain()` decision "parameter storage" says
to update shared parameters only through the optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from stratagem.errors import InputError


class InPlaceWatch:
    """Version counters of the parameters of the replicas that share storage, read at each step's start and end.

    Args:
        replicas: (replica index, module) of every replica whose in-place changes would not count once.
        consequence: what such a change did, for the error.
        fix: what the user should do instead, for the error.

    The cost is two reads of a counter per watched parameter and step, as cheap as reading its `.grad`.
    """

    def __init__(self, replicas: Sequence[tuple[int, nn.Module]], consequence: str, fix: str) -> None:
        self._watched = [(r, name, p) for r, module in replicas for name, p in module.named_parameters()]
        self._params = [p for _, _, p in self._watched]
        self._consequence = consequence
        self._fix = fix
        self._before: list[int] = []

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
        """Raises `InputError` when a watched parameter was changed in place since `begin_step`."""
        before, self._before = self._before, []
        if not before:
            return
        now = [p._version for p in self._params]
        if now == before:
            return
        for (replica, name, p), old, new in zip(self._watched, before, now):
            if new != old:
                raise InputError(
                    f"Parameter {name!r} was changed in place inside the step function (replica {replica}: {new - old} "
                    f"in-place operation(s)), outside the optimizer given to distribute(). {self._consequence} "
                    f"Received: an in-place change of {name!r} (shape {tuple(p.shape)}). {self._fix}"
                )
