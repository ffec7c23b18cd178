"""The local combination at the end of backward, with its work stealing (a data-parallel strategy's part).

`LocalCombine` is the part a strategy chooses (which reducer, and why: `choose_local_combine` for
Mirrored and MultiWorker, the central device's reduction for CentralStorage); `LocalCombination`
is the state of the meeting the replica set runs with it.

When a replica's backward pass ends, this process's replicas meet and each combines its share of
every gradient (`LocalReducer.combine_`), each replica's gradient weighted by its share of the
global batch; a parameter some replicas gave no gradient gets zeros there first, so every replica
holds the same set of gradients afterwards.

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
        self.full = []

    def grad_ready(self, replica: int, index: int) -> None:
        """Gradient `index` of `replica` is in: a replica waiting may combine it now."""
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
    ) -> Any:
        """`replica`'s part of the meeting at the end of backward; returns the combined gradient lists
        (one per replica) that the sum across workers continues from."""
        grads = [p.grad for p in replica_params[replica]]
        self.slots[replica] = grads
        weight = weights[replica]
        if reducer.prescale:
            present = [g for g in grads if g is not None]
            if weight == 0:
                torch._foreach_zero_(present)  # an empty slice's gradient may be NaN: it must not be scaled
            elif weight != 1.0:
                torch._foreach_mul_(present, weight)
        self.passes[replica] += 1
        current = self.passes[replica]
        steal = (lambda: self._claim(replica, current, replica_params, reducer, weights)) if self.stealing else None
        self._barrier.wait(replica, "end of backward", step, steal=steal)
        slots = self.slots
        keep: Sequence[int] = range(len(grads))
        if any(g is None for slot in slots for g in slot):
            keep = self._fill_missing_grads(replica, replica_params, slots, step)
        lists = [[slot[i] for i in keep] for slot in slots] if len(keep) != len(grads) else slots
        if self.stealing and lists[0]:
            # The claims are final: they were made before the last replica arrived at the barrier.
            done = {pos for pos, i in enumerate(keep) if self.claimed[i][replica] == current}
            reducer.combine_(replica, lists, weights, skip=done)  # type: ignore[call-arg]
        elif lists[0]:
            reducer.combine_(replica, lists, weights)
        self._barrier.wait(replica, "gradient combination", step)
        return lists

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

    def _fill_missing_grads(
        self, replica: int, replica_params: list[list[nn.Parameter]], slots: list[list[Any]], step: int
    ) -> list[int]:
        """A parameter some replicas gave no gradient: zeros there; one no replica touched stays None."""
        keep = [i for i in range(len(slots[0])) if any(slot[i] is not None for slot in slots)]
        mine = slots[replica]
        for i in keep:
            if mine[i] is None:
                param = replica_params[replica][i]
                param.grad = torch.zeros_like(param)
                mine[i] = param.grad
        self._barrier.wait(replica, "filling of missing gradients", step)
        return keep
