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

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from stratagem import environ
from stratagem.cluster import Cluster
from stratagem.cluster.worker_group import plan_worker_group
from stratagem.diagnose.memory_limit import read_memory_limit
from stratagem.errors import InputError
from stratagem.shm import eligibility
from stratagem.strategies.data_parallel.batch_norm import check_batch_norm_mode
from stratagem.strategies.data_parallel.combine import choose_local_combine
from stratagem.strategies.data_parallel.mirrored_replicas import MirroredReplicas
from stratagem.strategies.data_parallel.placement import nccl_available, place_replicas
from stratagem.strategies.data_parallel.replica_set import ReplicaSet
from stratagem.strategies.data_parallel.replicated import ReplicatedStrategy
from stratagem.strategies.multi_worker.across import AcrossWorkers
from stratagem.strategies.multi_worker.techniques import TECHNIQUES, Replicating, TechniquesPart
from stratagem.strategies.worker_group.agreement import BatchAgreement
from stratagem.strategies.worker_group.devices import default_local_devices
from stratagem.strategies.worker_group.input import InputSharding
from stratagem.strategies.worker_group.step_agreement import check_batches_flag
from stratagem.strategies.worker_group.stragglers import StepTimes, Straggler, StragglerWatch
from stratagem.strategies.worker_group.strategy import WorkerGroupStrategy
from stratagem.strategies.worker_group.techniques import ONE_DATA_AXIS, apply_techniques
from stratagem.trace import Recorder, Traceable
from stratagem.trace.clocks import align
from stratagem.trace.recorder import Clock, check_mode

if TYPE_CHECKING:
    from stratagem.strategies.memory_fit import Alternative, ReplicatedMemoryPlan

logger = logging.getLogger(__name__)


class MultiWorkerMirroredStrategy(WorkerGroupStrategy, ReplicatedStrategy, Traceable):
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

    samples_steps: ClassVar[bool] = True  # ReplicaSet ends every step with Recorder.after_step (fit samples them)

    # Parts, in the order a step meets them (each reports its own decisions to explain()); the members of a
    # strategy of one process per worker (who, across workers, input, batch check, close) are WorkerGroupStrategy's:
    #   the group   cluster.worker_group: the plan (cluster, rank, task names, timeout) checked first, then,
    #               once the devices are placed, the process group, CrossWorker and the same-devices check
    #   placement   data_parallel.placement.place_replicas: this worker's devices (worker_group/devices.py: the
    #               GPU of its local rank by default), memory limits, threads
    #   replicas    data_parallel.mirrored_replicas.MirroredReplicas: a copy per local device and their optimizer
    #   combine     data_parallel.combine.choose_local_combine: the local replicas first (several per worker)
    #   the set     data_parallel.replica_set.ReplicaSet: replica threads and barrier, run's weights, BatchNorm
    #               statistics (summed across workers), empty slices, declared loss weights, accumulation
    #   across      multi_worker.across.AcrossWorkers: the chief's values broadcast; gradients summed across
    #               workers (buckets overlapping backward, or after the local combination)
    #   input       worker_group.input.InputSharding / MultiWorkerDataset: each worker's part of the batches
    # `distribute` applies techniques.TECHNIQUES in order: replication along `data`, the model handed to the set.

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
        check_batches_flag(check_batches)
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
        group = self._join_group(plan, placement.devices, env=env)
        # Off until a trace starts: every part checks `recorder.on` before it takes a time (stratagem.trace).
        self._recorder = Recorder(rank=plan.rank, task=group.task_name, world_size=plan.world_size)
        group.cross_worker.trace.recorder = self._recorder
        self._traces = 0
        self._batch_agreement = BatchAgreement(rank=plan.rank, task_names=group.task_names, enabled=check_batches)
        self._step_times = StepTimes()
        self._across = AcrossWorkers(
            group,
            bucket_bytes=int(bucket_mb * 1024 * 1024),
            first_bucket_bytes=int(first_bucket_mb * 1024 * 1024),
            agreement=self._batch_agreement,
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
        self._trace_dir = environ.trace_dir(env)  # `stratagem launch --trace DIR`: the whole run, written at close
        self._finish_building()  # from now on, close() and the process's exit stop the replica threads, then the group
        self._across.connect_shared_memory(shared_memory)
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
        if self._recorder.recording:  # not `on`: a sampled trace is off between the steps it records
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
        copy of the training state that cannot fit is refused, naming a ShardedStrategy configuration that fits.
        Then the techniques in their order (techniques.py): replication along `data`."""
        self._check_limit(model, optimizer)
        self._check_distribute_args(model, optimizer, None)  # several models: ReplicaSet checks they share nothing
        placing = Replicating(model=model, optimizer=optimizer, replicas=self._replicas)
        apply_techniques(TECHNIQUES, placing, ONE_DATA_AXIS)
        return placing.distributed

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
                cut_at=lambda stage: cut_model(model, None, stage=stage), batch_check_copy=True,
            )  # fmt: skip

        check_plan_fits(
            plan.total,
            read_memory_limit(self.local_devices[0] if self.local_devices else None),
            strategy=f"MultiWorkerMirroredStrategy on {self._plan.world_size} workers",
            held=plan.user_model,  # built already: the limit counts it as used
            alternatives=alternatives,
        )

    _reads_files = True  # shard="file": each worker its own files of a FileDataset

    def _current_step(self) -> int:
        return self._replicas.step

    def _input_timing(self) -> tuple[StepTimes | None, Recorder | None]:
        return self._step_times, self._recorder

    @property
    def stragglers(self) -> list[Straggler]:
        """Each worker named slower than its peers so far (with its phase and every worker's median phase
        times), in order; `Straggler.to_dict()` for JSON. The chief also logs each as a warning."""
        return list(self._across.stragglers.named)

    def _parts(self) -> tuple[Any, ...]:
        return (TechniquesPart(), *self._replicas.parts, self._input_sharding)

    def _close_parts(self) -> None:
        """The trace written (under `stratagem launch --trace`), then the replica threads stopped."""
        if self._trace_dir is not None and self._recorder.on:
            self._recorder.stop()
            self._recorder.write(self._trace_dir)
        self._replicas.close()
