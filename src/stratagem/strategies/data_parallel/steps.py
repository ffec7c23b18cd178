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

Combined results are placed on the device of the batch the step was called with (the first tensor
argument), as one device would have returned them beside that batch.

Every tensor among the arguments is a global batch (its first dimension counts examples); other
arguments (numbers, strings, modules) reach every replica unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from stratagem.errors import InputError
from stratagem.values import ReduceOp, flatten, map_structure

if TYPE_CHECKING:
    from stratagem.strategies.base import Strategy

RETURNS = ("mean", "sum", "gather", "per_replica")
"""How `Strategy.step` combines the replicas' results."""


def check_returns(returns: str) -> None:
    if returns not in RETURNS:
        raise InputError(
            f"Unknown way to combine the replicas' results. Received: returns={returns!r}. "
            f"Use one of {', '.join(repr(r) for r in RETURNS)}."
        )


def make_step(
    strategy: "Strategy", fn: Callable[..., Any], returns: str, distribute_inputs: Callable[[Any], Any]
) -> Callable[..., Any]:
    """`fn` as a function of the global batch that runs once per replica (see the module docstring);
    `distribute_inputs` cuts the global batch `(args, kwargs)` among the strategy's local replicas."""
    if not callable(fn):
        raise InputError(
            f"step() needs the function to run once per replica. Received: {type(fn).__name__}. "
            "Use it as a decorator, @strategy.step, on the body of the loop."
        )
    check_returns(returns)

    @functools.wraps(fn, updated=())  # a wrapped nn.Module keeps its attributes to itself
    def run_step(*args: Any, **kwargs: Any) -> Any:
        home = _batch_device((args, kwargs))
        distributed_args, distributed_kwargs = distribute_inputs((args, kwargs))
        result = strategy.run(fn, args=distributed_args, kwargs=distributed_kwargs)
        if returns == "per_replica":
            return result
        if returns == "gather":
            # Leaf by leaf, in a plain dict: only plain containers travel between workers, and the result's own
            # class (a model's output object) is rebuilt here.
            leaves = flatten(result)
            gathered = strategy.gather({index: leaf for index, leaf in enumerate(leaves)})
            order = iter(range(len(leaves)))
            combined = map_structure(lambda leaf: gathered[next(order)], result)
        else:
            combined = strategy.reduce(ReduceOp.parse(returns), result)
        if home is None:
            return combined
        # Back where the caller's batch lives, so the loop's next lines (a loss against the labels of the
        # same batch, say) read as on one device.
        return map_structure(lambda leaf: leaf.to(home) if isinstance(leaf, torch.Tensor) else leaf, combined)

    return run_step


def _batch_device(inputs: Any) -> torch.device | None:
    """The device of the first tensor among a step's arguments (None when there is none)."""
    return next((leaf.device for leaf in flatten(inputs) if isinstance(leaf, torch.Tensor)), None)
