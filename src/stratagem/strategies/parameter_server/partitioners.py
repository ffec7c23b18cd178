"""How parameters are cut into shards and which parameter server holds each shard.

The partitioners follow tf.distribute's rules; each returns the number of shards along
dimension 0 for a tensor of a given shape and dtype:

- ``FixedShardsPartitioner(n)``: ``min(n, rows)``.
- ``MinSizePartitioner(min_shard_bytes=256 KiB, max_shards=1)``: ``ceil(total bytes / min_shard_bytes)``,
  at most ``max_shards`` and ``rows``, at least 1 (as TF computes it, so when the sizes do not
  divide a shard may fall a little under the minimum).
- ``MaxSizePartitioner(max_shard_bytes, max_shards=None)``: as few shards as keep each at most
  ``max_shard_bytes`` (whole rows; a single row larger than that is one shard), at most ``max_shards``.

Shards are contiguous along dimension 0 and the first shards take the extra rows: 13 rows over
5 shards are 3, 3, 3, 2, 2. ``place`` assigns shards to parameter servers round-robin in
parameter order (whole tensors when there is no partitioner).

    >>> FixedShardsPartitioner(5)((13, 4), torch.float32), shard_rows(13, 5)
    (5, [3, 3, 3, 2, 2])
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from stratagem.errors import InputError


def _element_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _positive_int(name: str, value: object, *, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(
            f"{name} must be a positive integer. Received: {name}={value!r}. "
            f"Pass an int >= 1{' or None' if allow_none else ''}."
        )


class Partitioner(abc.ABC):
    """Base: ``partitioner(shape, dtype)`` is the number of shards along dimension 0."""

    @abc.abstractmethod
    def _shards(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """The shard count this rule asks for; `__call__` bounds it by the rows there are."""

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        shape = tuple(shape)
        if not shape or shape[0] == 0:
            return 1  # a scalar or an empty tensor cannot be cut along dimension 0
        return max(1, min(shape[0], self._shards(shape, dtype)))


class FixedShardsPartitioner(Partitioner):
    """``num_shards`` shards, or one per row when there are fewer rows.

    Example:
        >>> FixedShardsPartitioner(num_shards=2)((10, 3), torch.float32)
        2
    """

    def __init__(self, num_shards: int) -> None:
        _positive_int("num_shards", num_shards)
        self.num_shards = num_shards

    def _shards(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return self.num_shards

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self.num_shards})"


class MinSizePartitioner(Partitioner):
    """Shards of at least about ``min_shard_bytes`` (256 KiB by default), at most ``max_shards``.

    Example:
        >>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), torch.float32)
        2
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1) -> None:
        _positive_int("min_shard_bytes", min_shard_bytes)
        _positive_int("max_shards", max_shards)
        self.min_shard_bytes = min_shard_bytes
        self.max_shards = max_shards

    def _shards(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        total = math.prod(shape) * _element_bytes(dtype)
        return min(self.max_shards, math.ceil(total / self.min_shard_bytes))

    def __repr__(self) -> str:
        return f"MinSizePartitioner(min_shard_bytes={self.min_shard_bytes}, max_shards={self.max_shards})"


class MaxSizePartitioner(Partitioner):
    """As few shards as keep each at most ``max_shard_bytes``, at most ``max_shards``.

    Example:
        >>> MaxSizePartitioner(max_shard_bytes=8)((6, 1), torch.float32)
        3
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None) -> None:
        _positive_int("max_shard_bytes", max_shard_bytes)
        _positive_int("max_shards", max_shards, allow_none=True)
        self.max_shard_bytes = max_shard_bytes
        self.max_shards = max_shards

    def _shards(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        row_bytes = math.prod(shape[1:]) * _element_bytes(dtype)
        rows_per_shard = max(1, self.max_shard_bytes // row_bytes) if row_bytes else shape[0]
        shards = math.ceil(shape[0] / rows_per_shard)
        return shards if self.max_shards is None else min(self.max_shards, shards)

    def __repr__(self) -> str:
        return f"MaxSizePartitioner(max_shard_bytes={self.max_shard_bytes}, max_shards={self.max_shards})"


def shard_rows(rows: int, num_shards: int) -> list[int]:
    """Rows of each shard: as even as possible, the first shards taking the extra rows."""
    base, extra = divmod(rows, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


@dataclass(frozen=True)
class Shard:
    """One piece of one parameter, held by one parameter server."""

    name: str
    """Unique name on the parameter servers: ``<parameter>`` or ``<parameter>/part_<i>``."""
    parameter: str
    """The model's parameter name (``0.weight``)."""
    ps: int
    """Index of the parameter server that holds it."""
    start: int
    """First row along dimension 0 (0 for a whole tensor)."""
    stop: int
    """One past the last row (``None``-free: a whole tensor ends at its row count; scalars at 1)."""
    group: int
    """Index of the optimizer's parameter group the parameter belongs to."""


def place(
    parameters: Iterable[tuple[str, torch.Tensor, int]],
    num_ps: int,
    partitioner: Partitioner | Callable[..., int] | None,
) -> list[Shard]:
    """Cuts each ``(name, tensor, group)`` into shards and deals them round-robin over ``num_ps`` servers.

    Example:
        >>> [(s.name, s.ps, s.start, s.stop) for s in place([("w", torch.zeros(5, 2), 0)], 2,
        ...                                                  FixedShardsPartitioner(2))]
        [('w/part_0', 0, 0, 3), ('w/part_1', 1, 3, 5)]
    """
    _positive_int("num_ps", num_ps)
    if partitioner is not None and not callable(partitioner):
        raise InputError(
            f"partitioner must be callable as partitioner(shape, dtype). "
            f"Received: {partitioner!r}. Pass a FixedShardsPartitioner, "
            "MinSizePartitioner or MaxSizePartitioner, or None."
        )
    shards = []
    turn = 0
    for name, tensor, group in parameters:
        rows = tensor.shape[0] if tensor.dim() else 1
        count = 1 if partitioner is None or tensor.dim() == 0 else partitioner(tuple(tensor.shape), tensor.dtype)
        if not isinstance(count, int) or not 1 <= count <= max(rows, 1):
            raise InputError(
                f"The partitioner returned an impossible shard count. Received: {count!r} "
                f"for {name} of shape {tuple(tensor.shape)}. Return 1..{max(rows, 1)}."
            )
        start = 0
        for i, size in enumerate(shard_rows(rows, count)):
            shard_name = name if count == 1 else f"{name}/part_{i}"
            shards.append(Shard(shard_name, name, turn % num_ps, start, start + size, group))
            start += size
            turn += 1
    return shards


def shard_of(tensor: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The rows of ``tensor`` that ``shard`` holds (a view; the whole tensor for a scalar)."""
    if tensor.dim() == 0 or (shard.start == 0 and shard.stop == tensor.shape[0]):
        return tensor
    return tensor[shard.start : shard.stop]
