"""The `model` axis's redistributions of one step, with their bytes: what `explain()` gives beside each split's kind
once `memory_plan(example_inputs=...)` has run its measuring step (one forward and a backward of the split model on
this group's part of a global batch, every worker together: `activation_memory.measure_split_step`).

Their sizes follow the activations (a partial output all-reduced is batch x features), so no layout alone gives
them. `StepBytes` is a dispatch mode, as torch's own `CommDebugMode`: it steps aside for every op on DTensors, so
that DTensor first turns it into plain ops and collectives, and counts each collective it then sees by op and mesh
axis, with the bytes this rank hands it (its part for an all-gather, its whole input otherwise; the trace counts
the same, `tracing.py`). Only the `model` axis is kept: the measuring step drops each gradient as it is accumulated,
before the data axis's sum, whose elements `decisions.py` counts from the layouts.

    >>> counting = StepBytes({"group 3": "model"})
    >>> with counting:
    ...     loss = model(x).sum()     # a split model's forward: its all-reduces and all-gathers are counted
    >>> counting.summary()
    'all-reduce 1 x 144 B'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stratagem import nest

_OPS = (  # a part of the op's name -> the op as explain() names it
    ("all_reduce", "all-reduce"),
    ("allreduce", "all-reduce"),
    ("all_gather", "all-gather"),
    ("allgather", "all-gather"),
    ("reduce_scatter", "reduce-scatter"),
    ("all_to_all", "all-to-all"),
    ("alltoall", "all-to-all"),
    ("broadcast", "broadcast"),
)


class StepBytes(TorchDispatchMode):
    """Counts the collectives run while it is entered whose process group is a `model` axis's: calls and bytes
    by op. `axes`: each group's name -> its mesh axis (from torch's DeviceMesh)."""

    def __init__(self, axes: Mapping[str, str]) -> None:
        super().__init__()
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
        from torch.distributed.tensor import DTensor

        self._axes = dict(axes)
        self._subclasses = (DTensor, AsyncCollectiveTensor)
        self.counts: dict[str, tuple[int, int]] = {}
        """op -> (calls, bytes) along the `model` axis, in the order first seen."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, self._subclasses) for t in types):
            return NotImplemented  # DTensor first turns it into plain ops and collectives, seen again here
        kwargs = kwargs or {}
        packet = getattr(func, "_overloadpacket", None)
        namespace, _, name = getattr(packet, "_qualified_op_name", "").partition("::")
        op = next((op for part, op in _OPS if part in name), None)
        if namespace in ("_c10d_functional", "c10d") and op is not None and self._axis(namespace, args) == "model":
            nbytes = sum(t.numel() * t.element_size() for t in nest.flatten(args[0]) if isinstance(t, torch.Tensor))
            calls, total = self.counts.get(op, (0, 0))
            self.counts[op] = (calls + 1, total + nbytes)
        return func(*args, **kwargs)

    def _axis(self, namespace: str, args: Any) -> str | None:
        """A functional collective's group is its last string argument; a `c10d` op's, the process group it takes."""
        import torch.distributed as dist

        if namespace == "_c10d_functional":
            names = [a for a in args[1:] if isinstance(a, str)]
            return self._axes.get(names[-1]) if names else None
        group = next((a for a in args[1:] if isinstance(a, torch.ScriptObject)), None)
        if group is None:
            return None
        try:
            return self._axes.get(dist.ProcessGroup.unbox(group).group_name)
        except RuntimeError:  # another script object (a reduce op): not a process group
            return None

    def summary(self) -> str:
        """``'all-reduce 2 x 288 B, all-gather 1 x 1.0 KiB'``: each op's calls and bytes in the step."""
        from stratagem.strategies.state_memory import show_bytes

        return ", ".join(f"{op} {calls} x {show_bytes(total)}" for op, (calls, total) in self.counts.items())
