"""Gradient accumulation without a combination per micro-batch: `strategy.no_sync()`.

Several backward passes before one `optimizer.step()` accumulate gradients in `.grad`, as on one
device. Without `no_sync()` every backward pass combines the replicas' gradients it reached (each
replica's whole `.grad`, accumulated part included, weighted by its share of the batch; the shares add
up to one, so what was combined before stays as it was and the new gradient joins it). Inside
`no_sync()` backward only accumulates each replica's own gradient, and the combination of the next
synchronised backward pass takes in everything accumulated since, every gradient present, reached by
that pass or not (`LocalCombination.take_in_accumulated`).

A replica's share of the global batch may differ from one micro-batch to the next (uneven splits,
a short last batch), so what a replica accumulates locally must carry each micro-batch's own
weight: after a `no_sync()` run every replica's `.grad` holds its weighted partial sum
``A = sum_k w_k * g_k``. The synchronised pass that follows multiplies each replica's whole `.grad`
by the replica's weight `w` of that pass before summing, so at the start of that run `.grad` is
divided by `w`: ``(A / w + g) * w = A + w * g``, exactly the sum one device accumulates (up to one
rounding of the division). A replica whose slice of the synchronising micro-batch is empty has
weight zero there and its partial sum could not be taken in: that case is refused before the run,
with the fix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from stratagem.errors import InputError
from stratagem.strategies.data_parallel.step_part import Built, RunState, StepPart


class LocalAccumulation(StepPart):
    """The no_sync() state of one strategy's replicas (see the module docstring); a part of the replica
    set of a strategy whose `no_sync()` skips combinations."""

    def __init__(self) -> None:
        self._params: list[list[nn.Parameter]] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._depth = 0  # no_sync() contexts entered and not left
        self.active = False
        """True once no_sync() was entered: from then on the gradient hooks ask `skips`."""
        self._local = [False]  # per replica: .grad holds the replica's own weighted partial sum
        self._weights: list[float] = []
        self._rescaled: list[bool] = []
        self._seen: list[bool] = []
        self._stash: list[list[torch.Tensor | None] | None] = []
        self._hooks: list[Any] = []

    def prepare(self, built: Built, replica_params: list[list[nn.Parameter]]) -> None:
        """The parameters (those that require grad) of each local replica and the plain optimizers that
        update them, from `distribute`."""
        self._params = [list(ps) for ps in replica_params]
        if len(self._local) != len(self._params):
            self._local = [False] * len(self._params)
        # Called once per distributed model: every model's optimizers are checked, those of a later model too.
        added = [opt for opt in built.plain_optimizers if all(opt is not known for known in self._optimizers)]
        self._optimizers += added
        if self.active:
            self._hooks += [opt.register_step_pre_hook(self._check_step) for opt in added]

    @property
    def pending(self) -> bool:
        """Whether some replica holds gradients no other replica has seen yet."""
        return any(self._local)

    @property
    def _uncombined(self) -> bool:
        """Whether some replica's gradients are still its own: accumulated under no_sync() and not
        taken into a synchronised backward pass of this run, or this is a no_sync() run."""
        if self._depth:
            return True
        return any(local and not (self._seen and self._seen[r]) for r, local in enumerate(self._local))

    # ---- the context ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self, inside_run: bool) -> Iterator[None]:
        if inside_run:
            raise InputError(
                "no_sync() was entered inside the function given to strategy.run(), where every replica would "
                "enter it on its own. Received: no_sync() on a replica's thread. Enter it around the call: "
                "`with strategy.no_sync(): strategy.run(step, args=(batch,))`."
            )
        if not self.active:
            self.active = True
            # optimizer.step() on gradients the replicas have not combined would update each replica
            # differently: refused, from any optimizer holding these parameters.
            self._hooks = [opt.register_step_pre_hook(self._check_step) for opt in self._optimizers]
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def skips(self, replica: int) -> bool:
        """From a gradient hook: True when this backward pass must not combine (inside no_sync())."""
        if self._depth:
            return True
        if self._seen:
            self._seen[replica] = True
        return False

    # ---- each run -------------------------------------------------------------------------------
    def begin_step(self, state: RunState) -> None:
        """Before the step function runs: prepares each replica's accumulated gradients for this run."""
        if not self.active:
            return
        step = state.step
        self._weights = list(state.weights)
        count = len(self._params)
        self._rescaled = [False] * count
        self._seen = [False] * count
        self._stash = [None] * count
        if not self.pending:
            return
        skipping = self._depth > 0
        for r in range(count):
            if not self._local[r]:
                continue
            grads = self._present(r)
            if self._weights[r] == 0:
                if not skipping:
                    raise InputError(
                        f"Step {step} would combine the gradients accumulated under no_sync(), but replica {r}'s "
                        f"slice of its batch is empty, so its accumulated part could not be weighted in. "
                        f"Received: replica weights {[round(w, 6) for w in self._weights]}. Give the batch that "
                        "ends an accumulation at least as many examples as there are replicas in sync, or "
                        "accumulate without no_sync() (each backward pass then combines)."
                    )
                # This micro-batch adds nothing for this replica: its partial sum waits aside.
                self._stash[r] = [p.grad for p in self._params[r]]
                for p in self._params[r]:
                    p.grad = None
            elif grads:
                torch._foreach_div_(grads, self._weights[r])
                self._rescaled[r] = True

    def end_run(self, state: RunState) -> None:
        """After the step function ran on every replica."""
        if not self.active or not self._weights:
            return
        if self._depth > 0:
            # Every replica's .grad becomes its weighted partial sum; a gradient that every replica held
            # combined (from a synchronised pass) counts with the weights too, which add up to one.
            for r in range(len(self._params)):
                self._weigh_locally(r)
                self._local[r] = True
        else:
            for r in range(len(self._params)):
                if self._rescaled[r] and not self._seen[r]:
                    torch._foreach_mul_(self._present(r), self._weights[r])  # no backward ran: undo
                elif self._seen[r]:
                    self._local[r] = False
        self._weights = []

    def _weigh_locally(self, r: int) -> None:
        stash = self._stash[r]
        if stash is not None:
            for p, g in zip(self._params[r], stash):
                p.grad = g
            return
        grads = self._present(r)
        if not grads:
            return
        if self._weights[r] == 0:
            torch._foreach_zero_(grads)  # an empty slice's gradient may be NaN: never multiplied
        else:
            torch._foreach_mul_(grads, self._weights[r])

    def _present(self, r: int) -> list[torch.Tensor]:
        return [p.grad for p in self._params[r] if p.grad is not None]

    def _check_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._uncombined:
            raise InputError(
                "optimizer.step() was called on gradients accumulated under no_sync(), which the replicas "
                "have not combined, so each replica would apply its own update. Received: a step inside no_sync(), "
                "or after no_sync() runs with no synchronised backward since. Run the last micro-batch's backward "
                "outside no_sync() before optimizer.step()."
            )

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
