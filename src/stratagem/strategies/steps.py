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

Every tensor among the arguments is a global batch whose dimension 0 counts examples, unless
`batch_dims` names another (`batch_dims=1` for every tensor of a `(seq, batch)` loop, or per argument,
`{"data": 1, "hidden": 1}`; data/batch_dims.py); arguments whose sizes along their batch dimensions
differ are refused before anything is cut, naming the argument. Other arguments (numbers, strings,
modules) reach every replica unchanged, and so does a `PerReplica` value (a step's `returns="per_replica"`
result handed back, such as a recurrent state that stays with its replica).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stratagem.data.batch_dims import BatchDims, check_batch_dims, check_batch_sizes, dim_of, from_front, to_front
from stratagem.errors import InputError
from stratagem.values import ReduceOp, flatten, map_structure

if TYPE_CHECKING:
    from stratagem.strategies.replica_context import ReplicaStrategy

RETURNS = ("mean", "sum", "gather", "per_replica")
"""How `Strategy.step` combines the replicas' results."""


def check_returns(returns: str) -> None:
    if returns not in RETURNS:
        raise InputError(
            f"Unknown way to combine the replicas' results. Received: returns={returns!r}. "
            f"Use one of {', '.join(repr(r) for r in RETURNS)}."
        )


def make_step(
    strategy: ReplicaStrategy,
    fn: Callable[..., Any],
    returns: str,
    distribute_inputs: Callable[[Any], Any],
    batch_dims: BatchDims = None,
) -> Callable[..., Any]:
    """`fn` as a function of the global batch that runs once per replica (see the module docstring);
    `distribute_inputs` cuts the global batch `(args, kwargs)` among the strategy's local replicas along
    dimension 0, after each argument's batch dimension (`batch_dims`) was moved there."""
    if not callable(fn):
        raise InputError(
            f"step() needs the function to run once per replica. Received: {type(fn).__name__}. "
            "Use it as a decorator, @strategy.step, on the body of the loop."
        )
    check_returns(returns)
    params = _parameters(fn)
    closed = params is not None and not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)
    check_batch_dims(batch_dims, [p.name for p in params] if params is not None and closed else None, where="step()")

    @functools.wraps(fn, updated=())  # a wrapped nn.Module keeps its attributes to itself
    def run_step(*args: Any, **kwargs: Any) -> Any:
        home = _batch_device((args, kwargs))
        names = _positional_names(params, len(args))
        named = {**dict(zip(names, args)), **kwargs}
        check_batch_sizes(named, batch_dims)  # before cutting: an argument of another size is never cut silently
        dims = [dim_of(batch_dims, name) for name in names]
        kwarg_dims = {key: dim_of(batch_dims, key) for key in kwargs}
        front_args = tuple(to_front(a, d) for a, d in zip(args, dims))
        front_kwargs = {key: to_front(v, kwarg_dims[key]) for key, v in kwargs.items()}
        cut_args, cut_kwargs = distribute_inputs((front_args, front_kwargs))
        distributed_args = tuple(from_front(c, d, a) for c, d, a in zip(cut_args, dims, args))
        distributed_kwargs = {key: from_front(c, kwarg_dims[key], kwargs[key]) for key, c in cut_kwargs.items()}
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


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    """The parameters of `fn` (of its forward for a module); None when they cannot be read."""
    try:
        signature = inspect.signature(fn.forward if isinstance(fn, nn.Module) else fn)
    except (TypeError, ValueError):
        return None
    return list(signature.parameters.values())


def _positional_names(params: list[inspect.Parameter] | None, count: int) -> list[str]:
    """The names the first `count` positional arguments bind to (`args[i]` where the signature does not say)."""
    names = []
    for i in range(count):
        if (
            params is not None
            and i < len(params)
            and params[i].kind in (params[i].POSITIONAL_ONLY, params[i].POSITIONAL_OR_KEYWORD)
        ):
            names.append(params[i].name)
        else:
            names.append(f"args[{i}]")
    return names


def _batch_device(inputs: Any) -> torch.device | None:
    """The device of the first tensor among a step's arguments (None when there is none)."""
    return next((leaf.device for leaf in flatten(inputs) if isinstance(leaf, torch.Tensor)), None)
