"""What a strategy whose state is sharded across processes offers `BackupAndRestore` (`Strategy.state_shards`).

A strategy whose every process holds the whole model and optimizer returns None from
`Strategy.state_shards()`, and the chief alone writes one file. A sharded one returns a `StateShards`:
every rank writes its own part of a checkpoint directory with ``torch.distributed.checkpoint``, hashes
the files it wrote, and every rank learns every rank's hashes, so the chief can write the manifest that
makes the directory a checkpoint. Nothing here gathers a whole tensor on one rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class ShardFile:
    """One file a rank wrote into a checkpoint directory, and its digest."""

    name: str
    """The file's name inside the checkpoint directory."""
    rank: int
    """The rank that wrote it."""
    sha256: str
    num_bytes: int


class StateShards(Protocol):
    """Saving and loading a model and optimizer whose tensors are sharded across the ranks of a job."""

    def save(self, directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[ShardFile]:
        """Every rank writes its shards of the model and optimizer tensors into `directory` (a collective:
        every rank calls it with the same directory); returns the files every rank wrote, on every rank."""
        ...

    def save_async(
        self, directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> Callable[[], list[ShardFile]]:
        """Copies this rank's shards (on the calling thread, at the step boundary; a collective: every rank calls
        it after the same step) and returns the write: a function, for one writer thread per rank, that writes
        the copy into `directory` and returns what `save` returns. The next call comes after that write ended."""
        ...

    def close(self) -> None:
        """Frees the buffers `save_async` kept, once no write runs (`BackupAndRestore` calls it when training ends)."""
        ...

    def load(
        self, directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, param_groups: list[dict[str, Any]]
    ) -> None:
        """Reads this rank's shards from a directory `save` wrote (at any number of ranks) into `model` and
        `optimizer`; `param_groups` are the optimizer's hyper-parameters as ``Optimizer.state_dict`` gives them."""
        ...

    def load_whole(
        self,
        model_state: dict[str, Any],
        optimizer_state: dict[str, Any],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        """Loads whole tensors (a single-file backup's ``model`` and ``optimizer``), each rank keeping its shard."""
        ...


def hash_file(path: Path, rank: int) -> ShardFile:
    """The sha256 and size of the file at `path` that `rank` wrote, read in pieces (memory stays flat)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return ShardFile(name=path.name, rank=rank, sha256=digest.hexdigest(), num_bytes=size)
