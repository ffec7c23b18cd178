"""`DeviceMesh`: the worker group's named degrees, in Keras 3's words (`keras.distribution.DeviceMesh`).

Plain data, checked before any process group exists (as torchtitan's `ParallelDims` is): a mesh's shape, the name of
each axis, and its product against the job's worker count. The worker group's plan carries one
(`worker_group.plan_worker_group`: one `data` axis over every worker unless a strategy gives another), and
`WorkerGroup.device_mesh()` makes torch's DeviceMesh of that shape with those names. Nothing here imports torch.

Example:
    >>> mesh = DeviceMesh((2, 2), ("data", "model"))
    >>> mesh.size, mesh.axis_size("model")
    (4, 2)
    >>> one_axis_mesh(3)
    DeviceMesh(shape=(3,), axis_names=('data',))
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from stratagem.errors import InputError


class DeviceMesh:
    """A grid of worker processes with a name for each axis (Keras 3's `keras.distribution.DeviceMesh`).

    Each worker process is one device of the mesh, in rank order (row-major: the last axis varies
    fastest, so on ``DeviceMesh((2, 2), ("data", "model"))`` ranks 0 and 1 split the model together).

    Example:
        >>> mesh = DeviceMesh((2, 2), ("data", "model"))
        >>> mesh.size, mesh.axis_size("model")
        (4, 2)
    """

    def __init__(self, shape: Sequence[int], axis_names: Sequence[str]) -> None:
        # A bare number or name stands for a one-axis mesh, as in Keras.
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)  # type: ignore[assignment]
        axis_names = tuple(axis_names) if isinstance(axis_names, (tuple, list)) else (axis_names,)  # type: ignore[assignment]
        if not shape or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape):
            raise InputError(
                f"A mesh's shape is one positive whole number per axis. Received: shape={shape!r}, "
                f"axis_names={axis_names!r}. Give e.g. DeviceMesh((2,), ('model',))."
            )
        if len(axis_names) != len(shape) or any(not isinstance(a, str) or not a for a in axis_names):
            raise InputError(
                f"A mesh names each of its axes with a string. Received: shape={shape!r}, axis_names={axis_names!r}. "
                f"Give {len(shape)} name(s), e.g. DeviceMesh((2, 2), ('data', 'model'))."
            )
        if len(set(axis_names)) != len(axis_names):
            raise InputError(
                f"A mesh's axis names must differ from each other. Received: shape={shape!r}, "
                f"axis_names={axis_names!r}. Rename the repeated axis."
            )
        self.shape: tuple[int, ...] = tuple(shape)
        self.axis_names: tuple[str, ...] = tuple(axis_names)

    @property
    def size(self) -> int:
        """The number of worker processes the mesh spans."""
        return math.prod(self.shape)

    def axis_size(self, name: str) -> int:
        """The number of workers along the axis `name` (1 for an axis the mesh does not have)."""
        return self.shape[self.axis_names.index(name)] if name in self.axis_names else 1

    def check_workers(self, world_size: int) -> None:
        """Refuses a mesh that does not span exactly `world_size` worker processes."""
        if self.size != world_size:
            raise InputError(
                f"The mesh spans {self.size} workers but the job has {world_size}. Received: shape={self.shape}, "
                f"axis_names={self.axis_names}, workers={world_size}. Give a shape whose product is {world_size}, "
                f"or launch {self.size} workers (stratagem launch --workers {self.size})."
            )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and (self.shape, self.axis_names) == (other.shape, other.axis_names)

    def __hash__(self) -> int:
        return hash((self.shape, self.axis_names))

    def __repr__(self) -> str:
        return f"DeviceMesh(shape={self.shape}, axis_names={self.axis_names})"


def one_axis_mesh(world_size: int, name: str = "data") -> DeviceMesh:
    """One axis called `name` over every worker: the worker group's mesh when its strategy gives none."""
    return DeviceMesh((world_size,), (name,))
