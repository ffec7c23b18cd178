"""Input read from a list of files, which MultiWorkerMirroredStrategy can shard by file.

Sharding by file lets each worker open only its own files (TF's AutoShardPolicy.FILE), instead of
every worker reading everything and keeping its part of each batch (sharding by data).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from stratagem.data.split import batch_size_of
from stratagem.errors import InputError
from stratagem.values import map_structure


@dataclass(frozen=True)
class FileDataset:
    """Batches of `batch_size` examples read, in order, from `files` with `read_file(path)`.

    `read_file` returns the examples of one file as a tensor or a tuple/dict of tensors sharing
    their first dimension. Under MultiWorkerMirroredStrategy, `distribute_dataset(FileDataset(...))`
    gives each worker every N-th file when there are at least as many files as workers.

    Example:
        >>> dataset = sg.data.FileDataset(sorted(glob("shards/*.pt")), torch.load, batch_size=256)
        >>> for x, y in strategy.distribute_dataset(dataset): ...
    """

    files: Sequence[str | Path]
    read_file: Callable[[str | Path], Any]
    batch_size: int

    def __post_init__(self) -> None:
        if isinstance(self.files, (str, Path)) or not len(self.files):
            raise InputError(f"FileDataset needs a non-empty list of files. Received: files={self.files!r}.")
        if self.batch_size < 1:
            raise InputError(f"batch_size must be at least 1. Received: batch_size={self.batch_size}.")

    def with_files(self, files: Sequence[str | Path], batch_size: int | None = None) -> "FileDataset":
        """The same reader over other files (and optionally another batch size)."""
        return replace(self, files=list(files), batch_size=batch_size or self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        pending: list[Any] = []
        count = 0
        for path in self.files:
            examples = self.read_file(path)
            n = batch_size_of(examples)
            start = 0
            while start < n:
                take = min(self.batch_size - count, n - start)

                def rows(t: Any, a: int = start, b: int = start + take) -> Any:
                    return t[a:b] if isinstance(t, torch.Tensor) else t

                pending.append(map_structure(rows, examples))
                count += take
                start += take
                if count == self.batch_size:
                    yield _concat(pending)
                    pending, count = [], 0
        if pending:
            yield _concat(pending)  # the last, short batch


def _concat(pieces: list[Any]) -> Any:
    if len(pieces) == 1:
        return pieces[0]
    columns = [list(column) for column in zip(*[_leaves(p) for p in pieces])]
    merged = iter([torch.cat(c) if isinstance(c[0], torch.Tensor) else c[0] for c in columns])
    return map_structure(lambda _: next(merged), pieces[0])


def _leaves(structure: Any) -> list[Any]:
    out: list[Any] = []
    map_structure(out.append, structure)
    return out
