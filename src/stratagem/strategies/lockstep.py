"""The step loop of synchronous strategies: every replica runs each global batch's step together.

`fit` and `evaluate` hand a step function and an iterable of GLOBAL ``(inputs, targets)`` batches
to `Strategy.run_fit_steps`, whose default is `run_in_lockstep`. The contract an override keeps
(the parameter server's, which schedules each step on a worker): iterate `batches` lazily, run
``step_fn(inputs, targets)`` on a replica for each one, call ``on_step(state)`` exactly once per
batch with that step's state summed over replicas and workers (a float64 tensor; the order of
calls may differ from the order of batches for an asynchronous strategy), and return only when
every step has been applied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from stratagem.errors import InputError
from stratagem.values import PerReplica

if TYPE_CHECKING:
    from stratagem.strategies.replica_context import ReplicaStrategy

StepFn = Callable[[Any, Any], torch.Tensor]
"""``step_fn(inputs, targets)`` on one replica -> that replica's metric state vector."""

OnStep = Callable[..., None]
"""``on_step(state, num_examples=None)``, once per step: the state vector summed over every replica and
worker (float64; on the device the strategy reduced it to, so reading it waits for that device), and the
step's global example count when the loop knows it without reading the state."""


def run_in_lockstep(strategy: ReplicaStrategy, step_fn: StepFn, batches: Iterable[Any], on_step: OnStep) -> None:
    """Distributes each global batch, runs `step_fn` on every replica, sums the states, calls `on_step`.

    Raises:
        InputError: a batch is not an ``(inputs, targets)`` pair.
    """
    for index, batch in enumerate(strategy.distribute_dataset(batches)):
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise InputError(
                f"Batch {index} is not an (inputs, targets) pair. Received: {_describe(batch)}. "
                "Make the loader yield (x, y) tuples, e.g. DataLoader(TensorDataset(x, y), batch_size=64)."
            )
        per_replica = strategy.run(step_fn, args=tuple(batch))
        # The state stays on the device the strategy reduced it to: a copy to the CPU here would make the CPU
        # wait for the GPU at every step. The step's example count is known on the host, from the batch.
        state = strategy.reduce("sum", per_replica).detach().to(dtype=torch.float64)
        on_step(state, _global_examples(batch[1]))


def _global_examples(targets: Any) -> int | None:
    """The examples of a distributed global batch, read from its sizes (no device read); None if unknown."""
    if isinstance(targets, PerReplica):
        if targets.global_size is not None:
            return int(targets.global_size)
        return None if targets.batch_sizes is None else int(sum(targets.batch_sizes))
    if isinstance(targets, torch.Tensor) and targets.dim() > 0:
        return int(targets.shape[0])
    return None


def _describe(batch: Any) -> str:
    if isinstance(batch, (tuple, list)):
        return f"a {type(batch).__name__} of {len(batch)} element(s)"
    return type(batch).__name__
