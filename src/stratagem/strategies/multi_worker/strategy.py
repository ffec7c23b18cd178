"""MultiWorkerMirroredStrategy: synchronous data parallelism across worker processes.

Each worker process holds one replica per local device, built from the same parts as MirroredStrategy;
across processes gradients are summed with `torch.distributed` (Gloo on CPU, NCCL on GPU), or,
when every worker runs on this host, through shared memory (`stratagem.shm.sums`).
With one local replica, gradients are copied (and weighted) into buckets as backward
produces them and each bucket's all-reduce starts at once, overlapping the rest of the
backward pass; with several, the local replicas combine first and replica 0 then sums
across workers. Every replica is weighted by its share of the GLOBAL batch, so the result
equals one device trained on the global batch, whatever the split.

The same training script as under MirroredStrategy runs unchanged; start one process per
worker with `stratagem launch --workers N script.py`, torchrun, SLURM or a TF_CONFIG.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stratagem import environ
from stratagem.cluster import Cluster
from stratagem.cluster.worker_group import WorkerGroup, plan_worker_group
from stratagem.data import worker_shards
from stratagem.data.batch_dims import BatchDimFirst, BatchDimRestored, check_batch_dim
from stratagem.data.files import FileDataset
from stratagem.data.split import split_sizes
from stratagem.diagnose.memory_limit import read_memory_limit
from stratagem.errors import InputError
from stratagem.shm import eligibility
from stratagem.strategies.batches import check_iterable
from stratagem.strategies.data_parallel.batch_norm import check_batch_norm_mode
from stratagem.strategies.data_parallel.combine import choose_local_combine
from stratagem.strategies.gather import from_bytes, to_bytes
from stratagem.strategies.data_parallel.mirrored_replicas import MirroredReplicas
from stratagem.strategies.data_parallel.placement import nccl_available, place_replicas
from stratagem.strategies.data_parallel.replica_set import ReplicaSet
from stratagem.strategies.data_parallel.replicated import ReplicatedStrategy
from stratagem.strategies.multi_worker.across import AcrossWorkers
from stratagem.strategies.multi_worker.agreement import BatchAgreement
from stratagem.strategies.multi_worker.stragglers import StepTimes, Straggler, StragglerWatch
from stratagem.strategies.multi_worker.devices import default_local_devices
from stratagem.strategies.multi_worker.input import InputSharding, MultiWorkerDataset, WorkerBatches
from stratagem.trace import Recorder, Traceable
from stratagem.trace.clocks import align
from stratagem.trace.recorder import Clock, check_mode

if TYPE_CHECKING:
    from stratagem.strategies.memory_fit import Alternative, ReplicatedMemoryPlan

logger = logging.getLogger(__name__)

SHARD_POLICIES = ("auto", "file", "data", "off")


class MultiWorkerMirroredStrategy(ReplicatedStrategy, Traceable):
    """Mirrored replicas on every worker process, kept identical by all-reduce (tf.distribute's MWMS).

    Args:
        devices: this worker's local devices (default: every visible GPU, else one CPU device).
        cluster: a `Cluster`, a TF_CONFIG-shaped dict, or None to resolve from TF_CONFIG,
            torchrun's or SLURM's variables.
        timeout: seconds any wait (rendezvous, collective, local replicas) may last before an
            error naming the missing task(s); a stall warning is logged at a quarter of it.
        bucket_mb: size of the gradient buckets (the first one is `first_bucket_mb`).
        shared_memory: sum CPU tensors across workers through shared memory when every worker runs on
            this host (None, the default: whenever they can; False: always through Gloo; True: an
            error unless they can). `explain()` says which, and why.
        batch_norm: "global" (default): BatchNorm statistics of the global batch of every worker;
            "per_replica": each replica's own slice (see MirroredStrategy).
        check_batches: True (default): every step, the workers compare a fingerprint of the step number and
            of the global batch they were handed (sent with the gradient sum), and all of them stop with an
            `InputError` naming the step, the workers and the first input that differs. False: no check
            (pass it on every worker alike).

    Example:
        >>> strategy = sg.MultiWorkerMirroredStrategy()       # under `stratagem launch --workers 2`
        >>> model, optimizer = strategy.distribute(Net(), torch.optim.SGD(...))
        >>> for x, y in strategy.distribute_dataset(loader):   # every worker iterates the same global batches
        ...     strategy.run(train_step, args=(x, y))
    """

    # Parts, in the order a step meets them (each reports its own decisions to explain()):
    #   the group   cluster.worker_group: the plan (cluster, rank, task names, timeout) checked first, then,
    #               once the devices are placed, the process group, CrossWorker and the same-devices check
    #   placement   data_parallel.placement.place_replicas: this worker's devices (multi_worker/devices.py: the
    #               GPU of its local rank by default), memory limits, threads
    #   replicas    data_parallel.mirrored_replicas.MirroredReplicas: a copy per local device and their optimizer
    #   combine     data_parallel.combine.choose_local_combine: the local replicas first (several per worker)
    #   the set     data_parallel.replica_set.ReplicaSet: replica threads and barrier, run's weights, BatchNorm
    #               statistics (summed across workers), empty slices, declared loss weights, accumulation
    #   across      multi_worker.across.AcrossWorkers: the chief's values broadcast; gradients summed across
    #               workers (buckets overlapping backward, or after the local combination)
    #   input       multi_worker.input.InputSharding / MultiWorkerDataset: each worker's part of the batches

    def __init__(
        self,
        devices: Sequence[str | torch.device] | None = None,
        *,
        cluster: Cluster | Mapping[str, Any] | None = None,
        timeout: float = 300.0,
        bucket_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        intra_op_threads: int | None = None,
        share_parameters: bool | None = None,
        shared_memory: bool | None = None,
        batch_norm: str = "global",
        check_batches: bool = True,
        registry: Any = None,
    ) -> None:
        if not isinstance(check_batches, bool):
            raise InputError(
                f"check_batches must be True or False. Received: check_batches={check_batches!r}. Pass a bool."
            )
        env = environ.current()
        eligibility.check_wanted(shared_memory, env)  # STRATAGEM_SHARED_MEMORY=0 against shared_memory=True
        mode = check_batch_norm_mode(batch_norm)
        # The plan first: a task that cannot join, or a bad timeout, is refused before any device is chosen.
        self._plan = plan = plan_worker_group(cluster, timeout=timeout, env=env)
        local_decision = None
        if devices is None:
            devices, local_decision = default_local_devices(plan.cluster, env, registry)
        placement = place_replicas(
            devices,
            require_gpu=False,
            registry=registry,
            intra_op_threads=intra_op_threads,
            devices_decision=local_decision,
        )
        self._group = group = WorkerGroup.start(plan, placement.devices, env=env)
        # Off until a trace starts: every part checks `recorder.on` before it takes a time (stratagem.trace).
        self._recorder = Recorder(rank=plan.rank, task=group.task_name, world_size=plan.world_size)
        group.cross_worker.trace.recorder = self._recorder
        self._traces = 0
        self._agreement = BatchAgreement(rank=plan.rank, task_names=group.task_names, enabled=check_batches)
        self._step_times = StepTimes()
        self._across = AcrossWorkers(
            group,
            bucket_bytes=int(bucket_mb * 1024 * 1024),
            first_bucket_bytes=int(first_bucket_mb * 1024 * 1024),
            agreement=self._agreement,
            times=self._step_times,
            stragglers=StragglerWatch(rank=plan.rank, task_names=group.task_names),
        )
        self._input_sharding = InputSharding()
        first_replica = plan.rank * len(group.local_devices)  # seeds each GPU replica's random stream
        self._replicas = ReplicaSet(
            self,
            placement,
            build=MirroredReplicas(share_parameters, first_replica),
            combine=choose_local_combine(group.local_devices, nccl_available=nccl_available(group.local_devices)),
            across=self._across,
            batch_norm=mode,
            timeout=plan.timeout,
            recorder=self._recorder,
        )
        self._closed = False
        # Registered after the group's own: at exit this one runs first and stops the replica threads,
        # then closes the group (whose own exit handler then finds it closed).
        atexit.register(_close_at_exit, weakref.ref(self))
        self._across.connect_shared_memory(shared_memory)
        self._gathers = 0
        self._barriers = 0
        self._trace_dir = environ.trace_dir(env)  # `stratagem launch --trace DIR`: the whole run, written at close
        if self._trace_dir is not None:
            self._start_trace(None)

    # ---- trace ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def trace(self, directory: str | Path, *, clock: Clock | None = None, mode: str = "spans") -> Iterator[Recorder]:
        """Records the steps run inside the block on every worker: input, forward, backward, optimizer step,
        each collective across workers and each wait for one. Every worker enters the block at the same
        point (its clock is aligned with the chief's there, through the job's store) and writes
        `directory`/worker-<rank>.json at its end; `stratagem trace merge DIR` and `stratagem trace summary
        DIR` read them. `clock`: the nanosecond clock of the spans (default time.perf_counter_ns); `mode`:
        "spans" keeps every span, "summary" only what the step table needs (stratagem.trace.fold).

        Example:
            >>> with strategy.trace("traces/"):
            ...     for x, y in strategy.distribute_dataset(loader):
            ...         strategy.run(train_step, args=(x, y))
        """
        if self._recorder.on:
            raise InputError(
                f"A trace is recording already (to {self._trace_dir!r}). Received: strategy.trace({str(directory)!r}) "
                "inside it. End the first trace, or unset STRATAGEM_TRACE (stratagem launch --trace) to trace "
                "only this range."
            )
        check_mode(mode)
        self._start_trace(clock, mode)
        try:
            yield self._recorder
        finally:
            self._recorder.stop()
            self._recorder.write(directory)
            self._recorder.clear()

    def _start_trace(self, clock: Clock | None, mode: str = "spans") -> None:
        recorder = self._recorder
        recorder.clear()
        if clock is not None:
            recorder.clock = clock
        self._traces += 1
        offset = align(
            self._group.cross_worker.store,
            rank=self._plan.rank,
            world_size=self._plan.world_size,
            clock=recorder.clock,
            round_id=str(self._traces),
            timeout=self._plan.timeout,
        )
        recorder.clock_offset = offset.to_dict()
        recorder.start(mode=mode)

    def distribute(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """As `ReplicatedStrategy.distribute`, after its memory plan is held against this process's limit: a whole
        copy of the training state that cannot fit is refused, naming a ShardedStrategy configuration that fits."""
        self._check_limit(model, optimizer)
        return super().distribute(model, optimizer)

    def memory_plan(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> ReplicatedMemoryPlan:
        """Bytes per process: the user's model, its replica, gradients, optimizer state and temporaries, and the
        shared-memory file of the sums (memory_fit.py)."""
        from stratagem.strategies.memory_fit import replicated_plan  # imports the sharded strategy's plan

        shared = self._group.cross_worker.shared
        buffers = 0 if shared is None else (shared.world_size + 1) * shared.capacity
        return replicated_plan(list(model.parameters()), optimizer, buffers=buffers)

    def _check_limit(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        from stratagem.strategies.memory_fit import check_plan_fits, sharded_alternatives
        from stratagem.strategies.sharded.units import cut_model

        plan = self.memory_plan(model, optimizer)
        shared = self._group.cross_worker.shared
        cut = None

        def alternatives() -> list[Alternative]:
            nonlocal cut
            cut = cut or cut_model(model, None)
            return sharded_alternatives(
                list(model.parameters()), optimizer, world_size=self._plan.world_size, stage=None,
                largest_unit_bytes=cut.largest_unit_bytes, num_units=len(cut.units),
                transport_per_worker=0 if shared is None else shared.capacity,
            )  # fmt: skip

        check_plan_fits(
            plan.total,
            read_memory_limit(self._local_devices[0] if self._local_devices else None),
            strategy=f"MultiWorkerMirroredStrategy on {self._plan.world_size} workers",
            held=plan.user_model,  # built already: the limit counts it as used
            alternatives=alternatives,
        )

    @property
    def cluster(self) -> Cluster:
        return self._plan.cluster

    @property
    def worker_group(self) -> WorkerGroup:
        """This process's place in the job: rank, task names, backend, process group, cross-worker collectives."""
        return self._group

    def input_pipeline(self) -> tuple[int, int]:
        return self._plan.world_size, self._plan.rank

    def _cross_worker_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        self._group.cross_worker.all_reduce_([out], what="reduce", step=self._replicas.step)
        return out

    def _gather_across_workers(self, items: list[Any]) -> list[Any]:
        """Every worker's replicas' contributions, in rank order (rank order is global batch order)."""
        self._gathers += 1
        group = self._group
        payloads = group.cross_worker.all_gather_bytes(
            to_bytes(items), what="gather", step=self._gathers, device=group.collective_device
        )
        out: list[Any] = []
        for rank, payload in enumerate(payloads):
            out.extend(items if rank == group.rank else from_bytes(payload, group.task_names[rank]))
        return out

    def barrier(self) -> None:
        """Waits until every worker has called `barrier()`, within the strategy's timeout; the error names the
        workers that did not arrive."""
        self._barriers += 1
        device = self._group.collective_device
        self._group.cross_worker.all_reduce_([torch.zeros(1, device=device)], what="barrier", step=self._barriers)

    @property
    def is_chief(self) -> bool:
        """True on rank 0, the worker that writes checkpoints and reports."""
        return self._plan.is_chief

    def _distribute_step_inputs(self, inputs: Any) -> Any:
        """This worker's part of the global batch given to a `step` function, cut among its replicas.

        Every worker calls the step with the same global batch (the same loader, seeded alike), as
        `distribute_dataset(shard="data")` assumes.
        """
        return self._worker_batches().step_inputs(inputs, self._replicas.step)

    # ---- input --------------------------------------------------------------------------------
    def distribute_dataset(  # type: ignore[override]
        self, dataset: Iterable[Any], shard: str = "auto", *, batch_dim: int = 0
    ) -> MultiWorkerDataset | BatchDimRestored:
        """Distributes a loader across workers and their local replicas.

        shard="data": every worker trains on its contiguous part of the same GLOBAL batches, so the split is
        the one a single process with all replicas would make (exact equivalence). A DataLoader over a
        map-style data set with a batch size (or batch sampler), or a `ShuffledBatches`, is cut at the index
        level: each worker reads only its part of each global batch. Any other input (an IterableDataset, a
        generator, a list of batches) is read whole by every worker, which keeps its part; `explain()`
        says which ("input sharding"). A DataLoader with torch's DistributedSampler (a DDP script's) is this
        worker's own part already: it is not cut again, and a step's global batch is every worker's batch.
        shard="file": the input is a `sg.data.FileDataset` with at least one file per worker; each
        worker reads every N-th file, in batches of its share of the global batch size.
        shard="auto" (default): "file" for a FileDataset with enough files, else "data".
        shard="off": each worker's loader already yields this worker's part of each step.
        The workers agree on when to stop: with shard="data" and loaders that know their length, once per
        pass (the shortest loader's length); otherwise at every step, that each of them has a batch. When
        one runs out they all stop at the same step, and what was left unused is logged.
        batch_dim: the dimension that counts examples, as in `Strategy.distribute_dataset`.
        """
        if batch_dim != 0:  # cut views with the batch dimension first, each piece moved back (data/batch_dims.py)
            check_batch_dim(batch_dim)
            return BatchDimRestored(self.distribute_dataset(BatchDimFirst(dataset, batch_dim), shard), batch_dim)
        check_iterable(dataset, "distribute_dataset")
        if shard not in SHARD_POLICIES:
            raise InputError(f"Unknown shard policy. Received: shard={shard!r}. Use one of {SHARD_POLICIES}.")
        world, rank = self._plan.world_size, self._plan.rank
        if shard == "auto":
            shard = "file" if isinstance(dataset, FileDataset) and len(dataset.files) >= world else "data"
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

    def _worker_batches(self) -> WorkerBatches:
        return WorkerBatches(self._group, self.num_replicas_in_sync, self._agreement, self._step_times, self._recorder)

    @property
    def stragglers(self) -> list[Straggler]:
        """Each worker named slower than its peers so far (with its phase and every worker's median phase
        times), in order; `Straggler.to_dict()` for JSON. The chief also logs each as a warning."""
        return list(self._across.stragglers.named)

    @property
    def check_batches(self) -> bool:
        """Whether the workers compare each step's number and global batch (the `check_batches` argument).
        Set it on every worker alike, between steps."""
        return self._agreement.enabled

    @check_batches.setter
    def check_batches(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise InputError(f"check_batches must be True or False. Received: {value!r}. Pass a bool.")
        self._agreement.enabled = value

    def shard_input(self, data: Any, *, note: bool = True) -> Any:
        """`data` cut at the index level for this worker where it can be (data/worker_shards.py), else as it is.

        `fit` calls it on its data before wrapping it, since what reaches `distribute_dataset` there is a generator.
        """
        local = len(self._group.local_devices)
        worker = worker_shards.WorkerRange(self.num_replicas_in_sync, self._plan.rank * local, local)
        data, decision = worker_shards.input_sharding(data, worker)
        if note and decision is not None:
            self._input_sharding.note(*decision)
        return data

    def _observe_input_sharding(self, index_level: bool, dataset: Any) -> None:
        seen = worker_shards.observed_sharding(index_level, dataset, self._input_sharding.choice)
        if seen is not None:
            self._input_sharding.note(*seen)

    def _parts(self) -> tuple[Any, ...]:
        return (*self._replicas.parts, self._input_sharding)

    def close(self) -> None:
        """Stops the replica threads and frees the process group (`WorkerGroup.close`). Runs by itself at exit."""
        self._close(release=True)

    def _close(self, release: bool) -> None:
        """`release`: hand the rendezvous store back (see `WorkerGroup.close`); not at exit."""
        if getattr(self, "_closed", True):
            return  # closed already (or never built)
        self._closed = True
        if self._trace_dir is not None and self._recorder.on:
            self._recorder.stop()
            self._recorder.write(self._trace_dir)
        super().close()
        self._group.close(release=release)


def _close_at_exit(ref: weakref.ref[MultiWorkerMirroredStrategy]) -> None:
    strategy = ref()
    if strategy is not None:
        strategy._close(release=False)
