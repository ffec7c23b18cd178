"""Per-replica values and the reduction vocabulary (`ReduceOp`, `PerReplica`), as in tf.distribute."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from stratagem import nest
from stratagem.errors import InputError


class ReduceOp(enum.Enum):
    """How `Strategy.reduce` combines the values of the replicas."""

    SUM = "sum"
    MEAN = "mean"

    @classmethod
    def parse(cls, op: "ReduceOp | str") -> "ReduceOp":
        """Accepts `ReduceOp.SUM`, "sum", "SUM", "mean", ..."""
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            try:
                return cls(op.lower())
            except ValueError:
                pass
        raise InputError(
            f"Unknown reduce op. Received: op={op!r}. Use 'sum', 'mean', sg.ReduceOp.SUM or sg.ReduceOp.MEAN."
        )


@dataclass(frozen=True)
class PerReplica:
    """One value per local replica, in replica order.

    `batch_sizes` is set when the values come from a distributed batch (or a `run` over one):
    it holds how many examples of the global batch each replica received, which `reduce`
    uses to weight a MEAN so that it equals the mean over the global batch.

    Example:
        >>> losses = strategy.run(train_step, args=(x, y))      # PerReplica
        >>> strategy.experimental_local_results(losses)          # (loss_replica0, loss_replica1)
    """

    values: tuple[Any, ...]
    batch_sizes: tuple[int, ...] | None = None
    global_size: int | None = None
    """Examples in the global batch across every worker (None: the sum of `batch_sizes`)."""
    weights: tuple[float, ...] | None = None
    """The loss weights the replicas declared with `sg.set_loss_weight` (token counts, say): a MEAN
    weights by these instead of `batch_sizes`."""

    def __len__(self) -> int:
        return len(self.values)

    def __repr__(self) -> str:
        sizes = "" if self.batch_sizes is None else f", batch_sizes={self.batch_sizes}"
        return f"PerReplica({list(self.values)!r}{sizes})"


def _is_per_replica(value: Any) -> bool:
    return isinstance(value, PerReplica)


def map_structure(fn: Callable[[Any], Any], structure: Any) -> Any:
    """Applies `fn` to every leaf of a nest (see `stratagem.nest`); a `PerReplica` is one leaf."""
    return nest.map_structure(fn, structure, _is_per_replica)


def flatten(structure: Any) -> list[Any]:
    """The leaves of a nest, in order; a `PerReplica` is one leaf."""
    return nest.flatten(structure, _is_per_replica)


def select_replica(structure: Any, replica: int) -> Any:
    """Replaces every `PerReplica` leaf by its value for `replica`; other leaves are shared."""
    return map_structure(lambda v: v.values[replica] if isinstance(v, PerReplica) else v, structure)


def stack_replicas(results: Sequence[Any], batch_sizes: tuple[int, ...] | None, global_size: int | None = None) -> Any:
    """Turns one result per replica into one result of `PerReplica` leaves.

    Results that are not nests of the same shape become one `PerReplica` of the whole results.
    """
    first = results[0]
    if not nest.is_nest(first, _is_per_replica):
        return PerReplica(tuple(results), batch_sizes, global_size)
    paths_per_replica = [[path for path, _ in nest.flatten_with_paths(r, "", _is_per_replica)] for r in results]
    if any(paths != paths_per_replica[0] for paths in paths_per_replica):
        return PerReplica(tuple(results), batch_sizes, global_size)
    leaves_per_replica = [flatten(r) for r in results]
    columns = iter(zip(*leaves_per_replica))
    return map_structure(lambda _: PerReplica(tuple(next(columns)), batch_sizes, global_size), first)


def tag_results(result: Any, counts: Sequence[float | None] | None) -> Any:
    """Gives every `PerReplica` of a step's result the loss weights its replicas declared (`sg.set_loss_weight`),
    which `reduce("mean")` weights by; the result as it is when a replica declared none."""
    if counts is None or any(c is None for c in counts):
        return result
    weights = tuple(float(c) for c in counts)  # type: ignore[arg-type]
    return map_structure(lambda v: dataclasses.replace(v, weights=weights) if isinstance(v, PerReplica) else v, result)
