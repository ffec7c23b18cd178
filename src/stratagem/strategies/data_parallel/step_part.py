"""The interface of a replica set's parts: what each does at `distribute`, around each step and at the end
of every backward pass (`StepPart`), and the state of the running step they share (`RunState`).

A `ReplicaSet` holds an ordered tuple of parts and calls each member on every part, in that order: a new
part is one more entry in the tuple (`ReplicaSet._step_parts`), not an edit of `run`, `distribute`, the
end-of-backward callback and `close`. Every member has a default that does nothing, so a part defines only
what it acts on. The set itself combines nothing: the parts that sum gradients (the local combination,
the sum across workers) are parts like the others, and a set without them leaves each replica's gradient
where autograd put it.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager

import torch
from torch import nn

from stratagem.diagnose import PlacementDecision

if TYPE_CHECKING:
    from stratagem.strategies.data_parallel.host import ReplicaHost
    from stratagem.strategies.data_parallel.placement import ReplicaDevices


@dataclass
class RunState:
    """What one `run` knows while its replicas compute."""

    step: int
    weights: list[float]
    """Each local replica's weight in the combined gradient: its share of the global batch."""
    batch_sizes: tuple[int, ...] | None = None
    """Each local replica's slice size in this step (None: not known from the inputs)."""
    counts: list[float | None] | None = None
    """Loss weights declared with sg.set_loss_weight in this step (None: weighting by examples)."""
    combined: list[int] | None = None
    """Positions (in each replica's parameter list) of the gradients the last backward pass combined, the ones it
    reached (None: every gradient present). Set by the combining parts; the loss weights divide these only."""
    met_counts: list[float | None] | None = None
    """`counts` as the local replicas' last meeting saw them: a replica that leaves the meeting first may declare the
    next pass's weight before the others divide by this pass's total."""


@dataclass(frozen=True)
class Built:
    """What a `ReplicaBuilder` made of the user's model and optimizer."""

    replicas: list[nn.Module]
    model: nn.Module
    """The model `distribute` returns."""
    optimizer: Any
    """The optimizer `distribute` returns (None without one)."""
    plain_optimizers: list[torch.optim.Optimizer]
    """The torch optimizers that update the replicas (accumulation checks their steps)."""
    primary: nn.Module | None = None
    """The module the returned model is outside a run, which the other replicas follow between steps
    (`outside_changes.py`); None: replica 0."""


class StepPart(abc.ABC):  # noqa: B024  # every member has a default: a part overrides what it acts on
    """One part of a replica set (see the module docstring). The set calls the members in this order."""

    acts_on_gradients = False
    """True for a part whose `grad_ready` or `end_of_backward` does something: the set hooks every
    parameter's gradient only when some part does."""

    def prepare(self, built: Built, replica_params: list[list[nn.Parameter]]) -> None:
        """At `distribute`, once the replicas exist (`replica_params`: each one's trainable parameters)."""

    def begin_step(self, state: RunState) -> None:
        """At the start of each `run`, before any replica runs the step function."""

    def grad_ready(self, replica: int, index: int, state: RunState) -> None:
        """During backward: gradient `index` of `replica` has been accumulated into its `.grad`."""

    def end_of_backward(self, replica: int, state: RunState) -> None:
        """When `replica`'s backward pass has finished, before `backward()` returns (on a GPU, on torch's
        autograd thread of that device, not the replica's own)."""

    def end_run(self, state: RunState) -> None:
        """After every replica returned from the step function, or one of them raised."""

    def decisions(self) -> list[PlacementDecision]:
        """What the part decided, for `explain()`."""
        return []

    def details(self) -> dict[str, str]:
        """Facts about the part for `explain()` (label -> text)."""
        return {}

    def close(self) -> None:
        """When the strategy closes: anything the part installed is removed."""


class ReplicaBuilder(StepPart):
    """The part that makes the replicas at `distribute` and keeps them fed at each step."""

    steal: bool
    """Whether a replica waiting at the end of backward may combine shares of the others' gradients."""
    accumulates: bool
    """Whether `no_sync()` skips the combination (False: every backward pass combines)."""
    first_global_replica: int = 0
    """The global index of this process's first replica (seeds each replica's random stream)."""

    @abc.abstractmethod
    def attach(self, host: ReplicaHost, placement: ReplicaDevices) -> None:
        """Once, by the set that holds the part: the replicas' host, and where they run."""

    @abc.abstractmethod
    def build(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Built:
        """The replicas, and the model and optimizer `distribute` returns."""

    def around_replica(self, replica: int) -> ContextManager[Any]:
        """Where replica `replica`'s step runs, on its thread (several replicas): as it is, or under the check
        that refuses a hand-written update of shared parameters before it runs (hand_updates.py)."""
        return contextlib.nullcontext()
