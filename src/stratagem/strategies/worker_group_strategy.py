"""`WorkerGroupStrategy`, the base of a strategy of one process (and one device) per worker: the `Strategy` members
it has because it runs on a `WorkerGroup` (where it runs, who the workers are, the waits and exchanges across all
of them), written once. ShardedStrategy is built on it; MultiWorkerMirroredStrategy keeps its own members, built
on its replica set, and TensorParallelStrategy its own, over its mesh's data axis."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from stratagem.strategies.base import Strategy
from stratagem.strategies.gather import from_bytes, to_bytes

if TYPE_CHECKING:
    from stratagem.cluster import Cluster
    from stratagem.cluster.worker_group import WorkerGroup


class WorkerGroupStrategy(Strategy):
    """`Strategy` members over `self._group` (the worker group) and `self._device` (this process's one device), which
    the subclass sets in its `__init__`."""

    _group: WorkerGroup
    _device: torch.device
    _gathers = 0  # how many gathers and barriers this process made: the step an error names
    _barriers = 0

    @property
    def _local_devices(self) -> list[torch.device]:
        return [self._device]

    @property
    def cluster(self) -> Cluster:
        return self._group.cluster

    @property
    def is_chief(self) -> bool:
        return self._group.is_chief

    def input_pipeline(self) -> tuple[int, int]:
        return self._group.world_size, self._group.rank

    def barrier(self) -> None:
        """Waits until every worker has called `barrier()`, within the strategy's timeout; the error names the
        workers that did not arrive."""
        self._barriers += 1
        device = self._group.collective_device
        self._group.cross_worker.all_reduce_([torch.zeros(1, device=device)], what="barrier", step=self._barriers)

    def _batch_norm_sum(self, tensor: torch.Tensor, what: str, step: int) -> None:
        self._group.cross_worker.all_reduce_([tensor], what=what, step=step)

    def _gather_across_workers(self, items: list[Any]) -> list[Any]:
        self._gathers += 1
        cw = self._group.cross_worker
        payloads = cw.all_gather_bytes(
            to_bytes(items), what="gather", step=self._gathers, device=self._group.collective_device
        )
        out: list[Any] = []
        for rank, payload in enumerate(payloads):
            out.extend(items if rank == cw.rank else from_bytes(payload, cw.task_names[rank]))
        return out
