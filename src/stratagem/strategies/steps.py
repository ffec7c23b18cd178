"""`Strategy.step`: the body of an existing training loop, run once per replica on the global batch.

A loop written for one device reads a global batch and runs a few lines on it. Wrapped with
`strategy.step`, those lines become a function that is still called with the global batch: the
wrapper cuts the batch among this worker's replicas (this worker's part of it under
MultiWorkerMirrored), runs the function once per replica with `Strategy.run`, and combines what
the replicas returned into what one device would have returned for the whole batch:

- ``returns="mean"`` (default): each leaf averaged over the global batch, every replica weighted by
  its share of it, so a mean loss comes back as the mean loss over the global batch;
- ``returns="sum"``: summed over replicas (and workers);
- ``returns="gather"``: concatenated in global batch order (`Strategy.gather`), for predictions;
- ``returns="per_replica"``: the `PerReplica` values `run` gave, for `reduce` or `gather` later.

Every tensor among the arguments is a global batch (its first dimension counts examples); other
arguments (numbers, strings, modules) reach every replica unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stratagem.errors import InputError
from stratagem.values import ReduceOp

if TYPE_CHECKING:
    from stratagem.strategies.base import Strategy

RETURNS = ("mean", "sum", "gather", "per_replica")
"""How `Strategy.step` combines the replicas' results."""


def check_returns(returns: str) -> None:
    if returns not in RETURNS:
        raise InputError(f"Unknown way to combine the replicas' results. Received: returns={returns!r}. "
                         f"Use one of {', '.join(repr(r) for r in RETURNS)}.")


def make_step(strategy: "Strategy", fn: Callable[..., Any], returns: str) -> Callable[..., Any]:
    """`fn` as a function of the global batch that runs once per replica (see the module docstring)."""
    if not callable(fn):
        raise InputError(f"step() needs the function to run once per replica. Received: {type(fn).__name__}. "
                         "Use it as a decorator, @strategy.step, on the body of the loop.")
    check_returns(returns)

    @functools.wraps(fn, updated=())  # a wrapped nn.Module keeps its attributes to itself
    def run_step(*args: Any, **kwargs: Any) -> Any:
        distributed_args, distributed_kwargs = strategy._distribute_step_inputs((args, kwargs))
        result = strategy.run(fn, args=distributed_args, kwargs=distributed_kwargs)
        if returns == "per_replica":
            return result
        if returns == "gather":
            return strategy.gather(result)
        return strategy.reduce(ReduceOp.parse(returns), result)

    return run_step
