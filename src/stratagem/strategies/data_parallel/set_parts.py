"""The parts a `ReplicaSet` is made of besides the replicas themselves, each a `StepPart`.

Which of them a set holds, and in which order, is decided in one place (`ReplicaSet._step_parts`):

- `LocalCombinationPart`: the local replicas' gradients combined at the end of backward (combine.py);
- `WorkerSumAfterCombination`, or `BucketSum` and `BucketRestart`: the sum across worker processes,
  after the local combination, or in buckets as backward produces the gradients of the one local replica
  (`strategies/multi_worker/across.py`);
- `LossWeights`: the division by the loss weights declared with `sg.set_loss_weight` (loss_weight.py);
- `BatchNormPart`: BatchNorm statistics (batch_norm.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from stratagem.collective.local import InMemoryReduce
from stratagem.diagnose import PlacementDecision
from stratagem.diagnose.placement import capture_placement
from stratagem.strategies.data_parallel import loss_weight
from stratagem.strategies.data_parallel.batch_norm import BatchNormSync, batch_norm_decision
from stratagem.strategies.data_parallel.combine import LocalCombination, LocalCombine
from stratagem.strategies.data_parallel.replicas import ReplicaBarrier
from stratagem.strategies.data_parallel.step_part import Built, RunState, StepPart

if TYPE_CHECKING:
    from stratagem.strategies.base import Strategy


class AcrossWorkers(Protocol):
    """What sums gradients across worker processes (`strategies/multi_worker/across.py`)."""

    world_size: int

    def prepare(self, replicas: list[nn.Module], replica_params: list[list[nn.Parameter]]) -> None: ...

    def begin_step(self, state: RunState) -> None: ...

    def grad_ready(self, index: int, state: RunState) -> None: ...

    def finish_backward(self, state: RunState) -> None: ...

    def after_backward(self, state: RunState) -> None: ...

    def sum_after_local_combine(
        self, replica: int, replica_params: list[list[nn.Parameter]], state: RunState
    ) -> None: ...

    def loss_weight_declared(self, count: float) -> None: ...

    def loss_weight_total(self, state: RunState, num_replicas_in_sync: int) -> float | None: ...

    def batch_norm_sum(self, tensor: torch.Tensor, what: str, step: int) -> Any: ...

    def decisions(self) -> list[PlacementDecision]: ...

    def details(self) -> dict[str, str]: ...


class LocalCombinationPart(StepPart):
    """The local replicas meet at the end of each backward pass and combine their gradients with the reducer
    `combine` chose; with `may_steal` (the builder allows it), a replica that arrives first may combine shares
    of the others' gradients of at least `steal_min()` elements."""

    acts_on_gradients = True

    def __init__(
        self,
        combine: LocalCombine,
        barrier: ReplicaBarrier,
        num_replicas: int,
        *,
        may_steal: bool,
        steal_min: Callable[[], int],
        accumulated: Callable[[], bool],
    ) -> None:
        self.combine = combine
        self._accumulated = accumulated
        self.combination = LocalCombination(barrier, num_replicas)
        self._may_steal = may_steal
        self._steal_min = steal_min
        self._params: list[list[nn.Parameter]] = []

    def prepare(self, built: Built, replica_params: list[list[nn.Parameter]]) -> None:
        self._params = replica_params
        if self._may_steal:
            # A share of a small gradient costs more in Python calls than it saves; those are combined after
            # the meeting, all in one call (a model of 300 small layers ran 30-50% slower stealing them all).
            steal = isinstance(self.combine.reducer, InMemoryReduce) and len(built.replicas) > 1
            self.combination.attach(replica_params, steal, self._steal_min())

    def begin_step(self, state: RunState) -> None:
        self.combination.begin_run()
        self.combination.reset(self._params)
        if self._accumulated():
            self.combination.take_in_accumulated()
        # Not while a placement log records: each replica logs its own work.
        self.combination.stealing = self.combination.steal and capture_placement() is None

    def grad_ready(self, replica: int, index: int, state: RunState) -> None:
        self.combination.grad_ready(replica, index)  # a replica waiting may combine this one now

    def end_of_backward(self, replica: int, state: RunState) -> None:
        def chosen(keep: list[int]) -> None:
            # Once, at the meeting, while every replica waits there; the sum across workers may widen `combined`.
            state.combined = keep
            state.met_counts = None if state.counts is None else list(state.counts)

        self.combination.combine(replica, self._params, self.combine.reducer, state.weights, state.step, chosen)

    def decisions(self) -> list[PlacementDecision]:
        return self.combine.decisions()

    def details(self) -> dict[str, str]:
        return self.combine.details()


class ReportedOnly(StepPart):
    """A part that does nothing in this set but report its decisions (a reducer with one replica)."""

    def __init__(self, part: StepPart) -> None:
        self.part = part

    def decisions(self) -> list[PlacementDecision]:
        return self.part.decisions()

    def details(self) -> dict[str, str]:
        return self.part.details()


class _AcrossPart(StepPart):
    """The sum across workers: prepared at `distribute`, told of each step and gradient, reporting its own."""

    acts_on_gradients = True

    def __init__(self, across: AcrossWorkers) -> None:
        self.across = across
        self._params: list[list[nn.Parameter]] = []

    def prepare(self, built: Built, replica_params: list[list[nn.Parameter]]) -> None:
        self._params = replica_params
        self.across.prepare(built.replicas, replica_params)

    def begin_step(self, state: RunState) -> None:
        self.across.begin_step(state)

    def grad_ready(self, replica: int, index: int, state: RunState) -> None:
        self.across.grad_ready(index, state)

    def decisions(self) -> list[PlacementDecision]:
        return self.across.decisions()

    def details(self) -> dict[str, str]:
        return self.across.details()


class WorkerSumAfterCombination(_AcrossPart):
    """Several local replicas: after their combination, replica 0 sums across workers for all of them."""

    def __init__(self, across: AcrossWorkers, barrier: ReplicaBarrier) -> None:
        super().__init__(across)
        self._barrier = barrier

    def end_of_backward(self, replica: int, state: RunState) -> None:
        # Not only when this worker has gradients: the others may, and every worker must join the sum.
        self.across.sum_after_local_combine(replica, self._params, state)
        self._barrier.wait(replica, "gradient combination across workers", state.step)


class BucketSum(_AcrossPart):
    """One local replica: its gradients went across in buckets as backward filled them; the last ones go and
    every sum is waited for at the end of backward."""

    def end_of_backward(self, replica: int, state: RunState) -> None:
        self.across.finish_backward(state)


class BucketRestart(StepPart):
    """After the gradients were divided by the loss weights (they are views of the buckets): the buckets are
    ready for another backward pass in the same step."""

    acts_on_gradients = True

    def __init__(self, across: AcrossWorkers) -> None:
        self.across = across

    def end_of_backward(self, replica: int, state: RunState) -> None:
        self.across.after_backward(state)


class LossWeights(StepPart):
    """Losses weighted by declared counts (`sg.set_loss_weight`): each combined gradient divided by their sum
    over every replica, once the combination (local, and across workers) is complete."""

    acts_on_gradients = True

    def __init__(self, num_local: int, num_replicas_in_sync: int, across: AcrossWorkers | None) -> None:
        self._num_local = num_local
        self._num_in_sync = num_replicas_in_sync
        self._across = across
        self._params: list[list[nn.Parameter]] = []

    def prepare(self, built: Built, replica_params: list[list[nn.Parameter]]) -> None:
        self._params = replica_params

    def declare(self, state: RunState, replica: int, count: float) -> None:
        loss_weight.declare(state, replica, count, self._num_local)
        if self._across is not None:
            self._across.loss_weight_declared(count)

    def end_of_backward(self, replica: int, state: RunState) -> None:
        total = self._total(state)
        if total is not None:
            params = self._params[replica]
            if state.combined is not None:  # not a gradient this pass left as an earlier one combined it
                params = [params[i] for i in state.combined]
            loss_weight.divide_gradients_(params, total)

    def _total(self, state: RunState) -> float | None:
        """The count the combined gradients are divided by (None: weighted by examples, nothing to divide)."""
        if self._across is not None:
            return self._across.loss_weight_total(state, self._num_in_sync)
        total, declared = loss_weight.local_total(state.met_counts)
        return loss_weight.check_total(total, declared, self._num_local, state.step)

    def details(self) -> dict[str, str]:
        where = " across all workers" if self._across is not None else ""
        return {
            "gradient weighting": (
                f"each replica's gradient weighted by its share of the global batch{where}, "
                "or by the loss weight its step declares (sg.set_loss_weight)"
            )
        }


class BatchNormPart(StepPart):
    """Which statistics BatchNorm layers use with more than one replica in sync, and the meetings that exchange
    them (`BatchNormSync`): the replicas are made from `convert(model)`, whose BatchNorm layers are converted
    copies, and `prepare` links those layers to the meetings."""

    def __init__(
        self,
        mode: str,
        *,
        strategy: Strategy,
        barrier: ReplicaBarrier,
        num_local: int,
        num_replicas_in_sync: int,
        weight: Callable[[int], float | None],
        step: Callable[[], int],
        across: AcrossWorkers | None,
    ) -> None:
        self.mode = mode
        self._num_in_sync = num_replicas_in_sync
        self.sync = BatchNormSync(
            mode,
            strategy=strategy,
            barrier=barrier,
            num_local=num_local,
            num_replicas_in_sync=num_replicas_in_sync,
            weight=weight,
            step=step,
            cross_worker_sum=across.batch_norm_sum if across is not None else None,
        )

    def convert(self, model: nn.Module) -> nn.Module:
        """What the replicas are made from (`BatchNormSync.convert`): the user's own modules stay as they are."""
        return self.sync.convert(model)

    def prepare(self, built: Built, replica_params: list[list[nn.Parameter]]) -> None:
        self.sync.attach(built.replicas)

    def begin_step(self, state: RunState) -> None:
        self.sync.begin_step()

    def decisions(self) -> list[PlacementDecision]:
        # Before distribute the decision holds for any BatchNorm layer the model may have; once a model without
        # one is distributed, there is nothing to decide.
        if self._num_in_sync == 1 or (self.sync.attached and self.sync.num_layers == 0):
            return []
        return [batch_norm_decision(self.mode)]

    def details(self) -> dict[str, str]:
        return self.sync.describe() if self._num_in_sync > 1 else {}

    def close(self) -> None:
        """Converted BatchNorm layers run as their plain class from then on."""
        self.sync.remove()
