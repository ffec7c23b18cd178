"""`WorkerGroupStrategy`, the base of a strategy of one process per worker: the `Strategy` members it has because
it runs on a `WorkerGroup` (where it runs, who the workers are, the waits and exchanges across all of them, each
worker's part of the input and the check that every worker was handed the same batch, the close at exit), written
once. MultiWorkerMirroredStrategy (over its replica set), ShardedStrategy and TensorParallelStrategy are built on
it; what differs is said by the members a subclass may override: `_worker_range` (which replicas of a global
batch are this worker's), `_leads_its_part`, `_current_step`, `_input_timing`, `_close_parts` and `_reads_files`.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from stratagem.cluster.worker_group import WorkerGroup
from stratagem.data import worker_shards
from stratagem.data.batch_dims import BatchDimFirst, BatchDimRestored, check_batch_dim
from stratagem.data.batches import check_iterable, check_shard_policy
from stratagem.data.files import FileDataset
from stratagem.data.split import split_sizes
from stratagem.errors import InputError
from stratagem.strategies.base import Strategy
from stratagem.strategies.gather import from_bytes, to_bytes
from stratagem.strategies.worker_group.agreement import BatchAgreement
from stratagem.strategies.worker_group.input import InputSharding, MultiWorkerDataset, WorkerBatches
from stratagem.strategies.worker_group.step_agreement import check_batches_flag
from stratagem.strategies.worker_group.stragglers import StepTimes

if TYPE_CHECKING:
    from stratagem.cluster import Cluster
    from stratagem.cluster.worker_group import Environ, WorkerGroupPlan
    from stratagem.trace import Recorder


class WorkerGroupStrategy(Strategy):
    """`Strategy` members over `self._group` (the worker group, joined with `_join_group`), `self._batch_agreement`
    (this worker's fingerprint of each step's batch) and `self._input_sharding`, which the subclass sets in its
    `__init__`."""

    _group: WorkerGroup
    _batch_agreement: BatchAgreement
    _input_sharding: InputSharding
    _reads_files = False  # whether shard="file" gives each worker its own files of a FileDataset
    _steps = 0
    _gathers = 0  # how many gathers and barriers this process made: the step an error names
    _barriers = 0
    _closed = True  # until `_finish_building`: the group's own exit handler closes it

    def _join_group(self, plan: WorkerGroupPlan, devices: Sequence[torch.device], *, env: Environ) -> WorkerGroup:
        """Starts the process group of `plan` on `devices` (closed by its own exit handler until
        `_finish_building`)."""
        self._group = WorkerGroup.start(plan, devices, env=env)
        return self._group

    def _finish_building(self) -> None:
        """Called last in `__init__`: from now on `close()`, or the process's exit, closes this strategy."""
        self._closed = False
        # Registered after the group's own: at exit this one runs first and stops what the strategy runs (replica
        # threads, hooks), then closes the group (whose own exit handler then finds it closed).
        atexit.register(_close_at_exit, weakref.ref(self))

    # ---- where and who ----------------------------------------------------------------------------
    @property
    def local_devices(self) -> list[torch.device]:
        return list(self._group.local_devices)

    @property
    def cluster(self) -> Cluster:
        return self._group.cluster

    @property
    def worker_group(self) -> WorkerGroup:
        """This process's place in the job: rank, task names, backend, process group, cross-worker collectives."""
        return self._group

    @property
    def is_chief(self) -> bool:
        """True on rank 0, the worker that writes checkpoints and reports."""
        return self._group.is_chief

    def input_pipeline(self) -> tuple[int, int]:
        return self._group.world_size, self._group.rank

    def _worker_range(self) -> worker_shards.WorkerRange:
        """The replicas of each global batch this worker trains: its local devices' among every worker's."""
        local = len(self._group.local_devices)
        return worker_shards.WorkerRange(self.num_replicas_in_sync, self._group.rank * local, local)

    def _leads_its_part(self) -> bool:
        """Whether this worker's own part (shard="off") counts in the step's global size: True unless other workers
        read the same part (a model group's)."""
        return True

    def _current_step(self) -> int:
        """The steps run so far: the step an error of the input or of a sum names."""
        return self._steps

    # ---- across workers ---------------------------------------------------------------------------
    def barrier(self) -> None:
        """Waits until every worker has called `barrier()`, within the strategy's timeout; the error names the
        workers that did not arrive."""
        self._barriers += 1
        device = self._group.collective_device
        self._group.cross_worker.all_reduce_([torch.zeros(1, device=device)], what="barrier", step=self._barriers)

    def cross_worker_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.detach().clone().to(self._group.collective_device)
        self._group.cross_worker.all_reduce_([out], what="reduce", step=self._current_step())
        return out.to(tensor.device)

    def _batch_norm_sum(self, tensor: torch.Tensor, what: str, step: int) -> None:
        self._group.cross_worker.all_reduce_([tensor], what=what, step=step)

    def gather_across_workers(self, items: list[Any]) -> list[Any]:
        """Every worker's replicas' contributions, in rank order (rank order is global batch order)."""
        self._gathers += 1
        cw = self._group.cross_worker
        payloads = cw.all_gather_bytes(
            to_bytes(items), what="gather", step=self._gathers, device=self._group.collective_device
        )
        out: list[Any] = []
        for rank, payload in enumerate(payloads):
            out.extend(items if rank == cw.rank else from_bytes(payload, cw.task_names[rank]))
        return out

    # ---- input --------------------------------------------------------------------------------------
    @property
    def check_batches(self) -> bool:
        """Whether the workers compare each step's number and global batch (the `check_batches` argument).
        Set it on every worker alike, between steps."""
        return self._batch_agreement.enabled

    @check_batches.setter
    def check_batches(self, value: bool) -> None:
        self._batch_agreement.enabled = check_batches_flag(value)

    def distribute_dataset(  # type: ignore[override]
        self, dataset: Iterable[Any], shard: str = "auto", *, batch_dim: int = 0
    ) -> MultiWorkerDataset | BatchDimRestored:
        """Distributes a loader across workers and their replicas.

        shard="data": every worker trains on the part of its replicas of the same GLOBAL batches, so the split is
        the one a single process with all replicas would make (exact equivalence). A DataLoader over a
        map-style data set with a batch size (or batch sampler), or a `ShuffledBatches`, is cut at the index
        level: each worker reads only its part of each global batch. Any other input (an IterableDataset, a
        generator, a list of batches) is read whole by every worker, which keeps its part; `explain()`
        says which ("input sharding"). A DataLoader with torch's DistributedSampler (a DDP script's) is this
        worker's own part already: it is not cut again, and a step's global batch is every worker's batch.
        shard="file" (where the strategy reads files: MultiWorkerMirroredStrategy): the input is a
        `sg.data.FileDataset` with at least one file per worker; each worker reads every N-th file, in batches
        of its share of the global batch size.
        shard="auto" (default): "file" for a FileDataset with enough files where the strategy reads files, else
        "data". shard="off": each worker's loader already yields this worker's part of each step.
        The workers agree on when to stop: with shard="data" and loaders that know their length, once per
        pass (the shortest loader's length); otherwise at every step, that each of them has a batch. When
        one runs out they all stop at the same step, and what was left unused is logged.
        batch_dim: the dimension that counts examples, as in `Strategy.distribute_dataset`.
        """
        if batch_dim != 0:  # cut views with the batch dimension first, each piece moved back (data/batch_dims.py)
            check_batch_dim(batch_dim)
            return BatchDimRestored(self.distribute_dataset(BatchDimFirst(dataset, batch_dim), shard), batch_dim)
        check_iterable(dataset, "distribute_dataset")
        check_shard_policy(shard)
        world, rank = self._group.world_size, self._group.rank
        if shard == "file" and not self._reads_files:
            raise InputError(
                f"{type(self).__name__} reads files through the data-parallel cut of each global batch. Received: "
                "shard='file'. Use shard='data' (or 'auto'), or give each worker its own files and use shard='off'."
            )
        if shard == "auto":
            files = self._reads_files and isinstance(dataset, FileDataset) and len(dataset.files) >= world
            shard = "file" if files else "data"
            if shard == "file":
                self._input_sharding.note("file", "a FileDataset with at least one file per worker")
        if shard == "file":
            if not isinstance(dataset, FileDataset) or len(dataset.files) < world:
                received = (
                    f"{len(dataset.files)} file(s)" if isinstance(dataset, FileDataset) else type(dataset).__name__
                )
                raise InputError(
                    f"shard='file' needs a sg.data.FileDataset with at least one file per worker ({world}). "
                    f"Received: {received}. Use shard='data', or split the input into more files."
                )
            mine = dataset.files[rank::world]
            dataset = dataset.with_files(mine, split_sizes(dataset.batch_size, world)[rank] or 1)
            return MultiWorkerDataset(self._worker_batches(), dataset, "off")
        if shard == "data":
            dataset = self.shard_input(dataset)
        return MultiWorkerDataset(self._worker_batches(), dataset, shard, on_first_batch=self._observe_input_sharding)

    def shard_input(self, data: Any, *, note: bool = True) -> Any:
        """`data` cut at the index level for this worker where it can be (data/worker_shards.py), else as it is.

        `fit` calls it on its data before wrapping it, since what reaches `distribute_dataset` there is a generator.
        """
        data, decision = worker_shards.input_sharding(data, self._worker_range())
        if note and decision is not None:
            self._input_sharding.note(*decision)
        return data

    def distribute_step_inputs(self, inputs: Any) -> Any:
        """This worker's part of the global batch given to a `step` function, cut among its replicas.

        Every worker calls the step with the same global batch (the same loader, seeded alike), as
        `distribute_dataset(shard="data")` assumes.
        """
        return self._worker_batches().step_inputs(inputs, self._current_step())

    def _worker_batches(self) -> WorkerBatches:
        return WorkerBatches(
            self._group,
            self._worker_range(),
            self._batch_agreement,
            *self._input_timing(),
            leads=self._leads_its_part(),
        )

    def _input_timing(self) -> tuple[StepTimes | None, Recorder | None]:
        """Where each step's input time goes: the phase times stragglers are judged by, and the trace's recorder
        (None, None: not measured)."""
        return None, None

    def _observe_input_sharding(self, index_level: bool, dataset: Any) -> None:
        seen = worker_shards.observed_sharding(index_level, dataset, self._input_sharding.choice)
        if seen is not None:
            self._input_sharding.note(*seen)

    # ---- the end ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stops what the strategy runs and frees the process group, handing the rendezvous store back (see
        `WorkerGroup.close`), so that a strategy built again in the same processes meets at the same address. Runs
        by itself at exit; a second call does nothing."""
        self._close(release=True)

    def _close(self, release: bool) -> None:
        """`release`: hand the rendezvous store back (see `WorkerGroup.close`); not at exit."""
        if self._closed:
            return  # closed already (or never joined)
        self._closed = True
        try:
            self._close_parts()
        finally:
            self._group.close(release=release)

    def _close_parts(self) -> None:
        """What the subclass runs beside the group (replica threads, hooks), stopped before the group closes."""


def _close_at_exit(ref: weakref.ref[WorkerGroupStrategy]) -> None:
    strategy = ref()
    if strategy is not None:
        strategy._close(release=False)
