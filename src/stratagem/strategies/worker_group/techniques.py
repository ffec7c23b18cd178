"""Techniques: ways of placing a model's state on mesh axes, each a function, applied in a written order.

A strategy of one process per worker is a record (`strategies/records.py`, whose `techniques_path` names the table)
plus its ordered table of techniques, as torchtitan's `parallelize_llama` applies tensor parallelism, then FSDP,
each a plain function:

- MultiWorkerMirroredStrategy: replication along `data` (`multi_worker/techniques.py`);
- ShardedStrategy: data sharding along `data`, FSDP2's units at its stage (`sharded/techniques.py`);
- TensorParallelStrategy: tensor parallel along `model`, data sharding along `data`, replication along `data`
  (`tensor_parallel/techniques.py`).

A `Technique` is generic over its strategy's placing state (`P`): what the techniques read (the model, the meshes,
the layouts, this worker's weight) and what each hands the ones after it. At `distribute` the strategy runs every
technique's check (`check_techniques`) before anything is placed, then applies the techniques in order
(`apply_techniques`), each only where the mesh has one of its axes; `techniques_decision` is `explain()`'s
`techniques` line. MultiWorkerMirrored's and Sharded's meshes have one axis, `data`, over every worker
(`ONE_DATA_AXIS`).

Example:
    >>> calls = []
    >>> table = (Technique(name="split", axes=("model",), apply=lambda p: calls.append("split")),
    ...          Technique(name="replication", axes=("data",), apply=lambda p: calls.append("sum")))
    >>> apply_techniques(table, None, ONE_DATA_AXIS)
    >>> calls
    ['sum']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from stratagem.diagnose import PlacementDecision

P = TypeVar("P")

ONE_DATA_AXIS: tuple[str, ...] = ("data",)
"""The axes of a strategy whose mesh is one `data` axis over every worker (MultiWorkerMirrored, Sharded)."""


class Removable(Protocol):
    """What a technique leaves on the model that the strategy takes off at `close()` (a hook's handle, a sum)."""

    def remove(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class Technique(Generic[P]):
    """One technique: its name as explain() says it, the mesh axes it works over, its function and its check."""

    name: str
    """As `explain()` names it."""
    axes: tuple[str, ...]
    """The mesh axes it works over; it is skipped on a mesh that has none of them."""
    apply: Callable[[P], None]
    """Applies it to the placing state's model, recording on the state what it leaves there for later ones."""
    check: Callable[[P], None] | None = None
    """Refuses, before any technique is applied, what it cannot honour (an `InputError` with the fix); None: none."""


def applies(technique: Technique[P], axis_names: Sequence[str]) -> bool:
    """Whether the mesh of `axis_names` has one of the technique's axes."""
    return any(axis in axis_names for axis in technique.axes)


def check_techniques(techniques: Sequence[Technique[P]], placing: P, axis_names: Sequence[str]) -> None:
    """Each applicable technique's check, in order, before any technique is applied."""
    for technique in techniques:
        if technique.check is not None and applies(technique, axis_names):
            technique.check(placing)


def apply_techniques(techniques: Sequence[Technique[P]], placing: P, axis_names: Sequence[str]) -> None:
    """Applies each technique whose axes the mesh has, in the table's order, to the same placing state."""
    for technique in techniques:
        if applies(technique, axis_names):
            technique.apply(placing)


def techniques_decision(
    techniques: Sequence[Technique[P]],
    axis_names: Sequence[str],
    *,
    reason: str,
    notes: Mapping[str, str] | None = None,
) -> PlacementDecision:
    """`explain()`'s `techniques` line: which techniques apply on the mesh of `axis_names`, in their order, over
    which axes (`notes`: a few words after a technique's name, by name), and why in this order."""
    notes = notes or {}
    applied = [t for t in techniques if applies(t, axis_names)]
    choice = ", then ".join(f"{t.name} on {'/'.join(t.axes)}{notes.get(t.name, '')}" for t in applied)
    return PlacementDecision(subject="techniques", choice=choice, reason=reason)
