"""The local combination at the end of backward, with its work stealing (a data-parallel strategy's part).

`LocalCombine` is the part a strategy chooses (which reducer, and why: `choose_local_combine` for
Mirrored and MultiWorker, the central device's reduction for CentralStorage); `LocalCombination`
is the state of the meeting the replica set runs with it.

When a replica's backward pass ends, this process's replicas meet and each combines its share of
every gradient that pass reached (`LocalReducer.combine_`), each replica's gradient weighted by its
share of the global batch; a parameter some replicas gave no gradient gets zeros there first, so every
replica holds the same set of gradients afterwards.

Only the parameters the pass reached on some replica (their post-accumulate hooks marked them,
`reached`) are combined: one that kept a gradient from an earlier pass of the step (a GAN's generator
while the discriminator's pass runs) already holds the combined value on every replica. Combining it
again would only cost time while the weights add up to one, and would change it where they do not: a
pass whose declared loss weights (`sg.set_loss_weight`) add up to 0 multiplies it by 0 and divides by
nothing. The exception is the first pass of a run that takes in gradients accumulated under
`no_sync()` (`take_in_accumulated`): those are each replica's own, reached or not, so every gradient
is combined, as before.

Work stealing (in-memory reduction only): a replica that finishes its backward pass first combines,
while it waits, shares of the parameters whose gradients every replica already has. `ready[r][i]` /
`claimed[i][k]` hold the number of the backward pass (per run) in which replica r produced gradient
i / share k of gradient i was combined, so nothing needs clearing between passes. Only gradients of
at least `STEAL_MIN_ELEMENTS` per share are stolen (the strategy decides, see `attach`): a share of
a small gradient costs more in Python calls than it saves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from stratagem.collective.local import LocalReducer, choose_local_reducer
from stratagem.diagnose import PlacementDecision
from stratagem.strategies.data_parallel.replicas import ReplicaBarrier


@dataclass(frozen=True)
class LocalCombine:
    """The local-combination part: the reducer that sums this process's replicas' gradients, and why."""

    reducer: LocalReducer
    decision: PlacementDecision | None
    """None where there is nothing to say (one replica)."""

    def decisions(self) -> list[PlacementDecision]:
        return [] if self.decision is None else [self.decision]

    def details(self) -> dict[str, str]:
        return {}


def choose_local_combine(devices: Sequence[torch.device], *, nccl_available: bool) -> LocalCombine:
    """In memory, NCCL or onto one device (`collective.local.choose_local_reducer`); said with several replicas."""
    reducer, decision = choose_local_reducer(devices, nccl_available=nccl_available)
    return LocalCombine(reducer, decision if len(devices) > 1 else None)


class LocalCombination:
    """The state of the end-of-backward meeting of one process's replicas, and its arithmetic."""

    def __init__(self, barrier: ReplicaBarrier, num_replicas: int) -> None:
        self._barrier = barrier
        self._num_replicas = num_replicas
        self.steal = False  # the reduction allows it (in memory, several replicas)
        self.stealing = False  # in this run: not while a placement log records, so each replica logs its own work
        self.stealable: list[bool] = []  # large enough that combining one share early pays for the Python it costs
        self.passes: list[int] = []
        self.ready: list[list[int]] = []
        self.claimed: list[list[int]] = []
        self.full: list[int] = []  # gradients every replica has produced in the current pass, to claim from
        self.slots: list[Any] = [None] * num_replicas
        self.reached: list[list[int]] = []  # reached[r][i]: the last pass (per run) whose backward reached it on r
        self.whole_passes = 0  # passes of this run that combine every gradient (accumulated under no_sync())
        self.keep: list[int] = []
        """The gradients the last meeting combined (positions in each replica's list), chosen by its last arrival."""
        self.late = False

    def attach(self, replica_params: list[list[nn.Parameter]], steal: bool, min_elements: int) -> None:
        """Once the replicas exist: which gradients a waiting replica may combine early."""
        self.steal = steal
        self.stealable = [p.numel() // len(replica_params) >= min_elements for p in replica_params[0]]
        self.reset(replica_params)

    def begin_run(self) -> None:
        # The last step's gradients must not outlive zero_grad(): held here, they would make backward
        # take fresh memory every step (page faults) instead of reusing theirs.
        self.slots = [None] * self._num_replicas

    def reset(self, replica_params: list[list[nn.Parameter]]) -> None:
        num_params = len(replica_params[0]) if replica_params else 0
        self.passes = [0] * self._num_replicas
        self.ready = [[0] * num_params for _ in range(self._num_replicas)]
        self.claimed = [[0] * self._num_replicas for _ in range(num_params)]
        self.reached = [[0] * num_params for _ in range(self._num_replicas)]
        self.full = []
        self.whole_passes = 0

    def take_in_accumulated(self) -> None:
        """This run's first pass combines every gradient: the replicas hold their own, accumulated under no_sync()."""
        self.whole_passes = 1

    def grad_ready(self, replica: int, index: int) -> None:
        """Gradient `index` of `replica` is in: this pass combines it, and a replica waiting may combine it now."""
        self.reached[replica][index] = self.passes[replica] + 1  # written by this replica's backward only
        if self.stealing and self.stealable[index]:
            self._barrier.notify(lambda: self._mark_ready(replica, index))

    def _mark_ready(self, replica: int, index: int) -> None:
        """Under the barrier's lock: gradient `index` of `replica` is in; once every replica's is, it can be claimed."""
        current = self.passes[replica] + 1
        self.ready[replica][index] = current
        if all(ready[index] == current for ready in self.ready):
            self.full.append(index)

    def combine(
        self,
        replica: int,
        replica_params: list[list[nn.Parameter]],
        reducer: LocalReducer,
        weights: list[float],
        step: int,
        chosen: Callable[[list[int]], None] | None = None,
    ) -> Any:
        """`replica`'s part of the meeting at the end of backward; returns the combined gradient lists
        (one per replica) that the sum across workers continues from. `chosen` is told, once, before any replica
        leaves the meeting, which gradients it combines (positions in each replica's list)."""
        grads = [p.grad for p in replica_params[replica]]
        self.slots[replica] = grads
        current = self.passes[replica] + 1
        if reducer.prescale:
            mine = self.reached[replica]
            self._scale_([g for i, g in enumerate(grads) if g is not None and mine[i] == current], weights[replica])
        self.passes[replica] = current
        steal = (lambda: self._claim(replica, current, replica_params, reducer, weights)) if self.stealing else None
        self._barrier.wait(replica, "end of backward", step, steal=steal, last=lambda: self._choose(current, chosen))
        slots = self.slots
        keep = self.keep
        if self.late:
            self._fill_late(
                replica, replica_params, keep, current, weights[replica] if reducer.prescale else None, step
            )
        lists = [[slot[i] for i in keep] for slot in slots] if len(keep) != len(grads) else slots
        if self.stealing and lists[0]:
            # The claims are final: they were made before the last replica arrived at the barrier.
            done = {pos for pos, i in enumerate(keep) if self.claimed[i][replica] == current}
            reducer.combine_(replica, lists, weights, skip=done)  # type: ignore[call-arg]
        elif lists[0]:
            reducer.combine_(replica, lists, weights)
        self._barrier.wait(replica, "gradient combination", step)
        return lists

    @staticmethod
    def _scale_(grads: list[torch.Tensor], weight: float) -> None:
        """A prescaling reducer's input: this replica's gradients times its weight."""
        if weight == 0:
            torch._foreach_zero_(grads)  # an empty slice's gradient may be NaN: it must not be scaled
        elif weight != 1.0:
            torch._foreach_mul_(grads, weight)

    def _claim(
        self,
        replica: int,
        current: int,
        replica_params: list[list[nn.Parameter]],
        reducer: LocalReducer,
        weights: list[float],
    ) -> Callable[[], None] | None:
        """Called with the barrier's lock held by `replica`, waiting at the end of backward pass `current`:
        claims one share of a parameter whose gradient every replica has produced (another replica's
        share first: that one would otherwise do it after the meeting) and returns the job that combines
        it, with the same arithmetic as after the meeting; None when there is nothing to claim."""
        shares = [k for k in range(self._num_replicas) if k != replica] + [replica]
        while self.full:  # the gradient that became complete last first: backward produces the last layers first
            i = self.full[-1]
            # Every replica's gradient i is in (a post-accumulate hook marked it), so none is None.
            grads = cast("list[list[torch.Tensor]]", [[params[i].grad] for params in replica_params])
            if all(ready[i] == current for ready in self.ready) and all(g[0].is_contiguous() for g in grads):
                for share in shares:
                    if self.claimed[i][share] != current:
                        self.claimed[i][share] = current
                        return lambda: reducer.combine_(share, grads, weights)
            self.full.pop()  # every share claimed, from an earlier pass, or combined whole after the meeting
        return None

    def _choose(self, current: int, chosen: Callable[[list[int]], None] | None) -> None:
        """Run by the last replica to arrive at the meeting of pass `current`: which gradients it combines (those
        the pass reached on some replica; every one present where the pass takes in no_sync() accumulations), and
        whether some replica holds one of them that its own pass did not reach (`late`)."""
        if current <= self.whole_passes:
            slots = self.slots
            self.keep = [i for i in range(len(slots[0])) if any(slot[i] is not None for slot in slots)]
        else:
            self.keep = [i for i, passes in enumerate(zip(*self.reached)) if current in passes]
        self.late = any(self.reached[r][i] != current for r in range(self._num_replicas) for i in self.keep)
        if chosen is not None:
            chosen(self.keep)

    def _fill_late(
        self,
        replica: int,
        replica_params: list[list[nn.Parameter]],
        keep: Sequence[int],
        current: int,
        weight: float | None,
        step: int,
    ) -> None:
        """The gradients this pass combines that it did not reach on `replica` (reached on other replicas only,
        or taken in from no_sync()): zeros where there is none, so every replica combines it, and times the
        replica's `weight` for a prescaling reducer (None: the reducer weighs)."""
        mine = self.slots[replica]
        scale = []
        for i in keep:
            if self.reached[replica][i] == current:
                continue
            if mine[i] is None:
                param = replica_params[replica][i]
                param.grad = torch.zeros_like(param)
                mine[i] = param.grad
            elif weight is not None:
                scale.append(mine[i])
        if weight is not None and scale:
            self._scale_(scale, weight)
        self._barrier.wait(replica, "filling of missing gradients", step)
