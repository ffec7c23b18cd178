"""In-place changes to parameters that replicas share, made in the step function outside the optimizer.

Replicas that read one copy of the parameters (Mirrored's shared parameters on logical devices of one CPU,
CentralStorage's replicas that compute on the central device) each run the whole step function. An update
written by hand there (`p -= lr * p.grad` under `no_grad`, `torch._foreach_add_(params, grads)`) runs on
every replica and lands on the same memory: N updates per step instead of one. Without an optimizer the
replicas never share (each updates its own copy, which is exact); with one, `InPlaceWatch` reads each
replica parameter's version counter, which torch's in-place operations on that parameter advance and the
strategy's own optimizer (working on views taken through `.data`) does not, and stops at the end of the
first step that changed one, naming it. CentralStorage watches its compute copies too: a change
there is overwritten by the central parameters at the next step. Changes made through `p.data` advance no counter of `p`; the
`explain()` decision "parameter storage" says to update shared parameters only through the optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from stratagem.errors import InputError


def version_of(parameter: nn.Parameter) -> int:
    """torch's count of in-place operations on `parameter` (autograd's check that saved tensors are unchanged)."""
    return parameter._version


class InPlaceWatch:
    """Version counters of the parameters of the replicas that share storage, read at each step's start and end.

    Args:
        replicas: (replica index, module) of every replica whose in-place changes would not count once.
        consequence: what such a change did, for the error.
        fix: what the user should do instead, for the error.
    """

    def __init__(self, replicas: Sequence[tuple[int, nn.Module]], consequence: str, fix: str) -> None:
        self._watched = [(r, name, p) for r, module in replicas for name, p in module.named_parameters()]
        self._consequence = consequence
        self._fix = fix
        self._before: list[int] = []

    def begin_step(self) -> None:
        self._before = [version_of(p) for _, _, p in self._watched]

    def end_step(self) -> None:
        """Raises `InputError` when a watched parameter was changed in place since `begin_step`."""
        if not self._before:
            return
        before, self._before = self._before, []
        for (replica, name, p), version in zip(self._watched, before):
            now = version_of(p)
            if now != version:
                raise InputError(
                    f"Parameter {name!r} was changed in place inside the step function (replica {replica}: {now - version} "
                    f"in-place operation(s)), outside the optimizer given to distribute(). {self._consequence} "
                    f"Received: an in-place change of {name!r} (shape {tuple(p.shape)}). {self._fix}"
                )
