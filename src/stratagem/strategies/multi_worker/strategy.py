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
import logging
import socket
import sys
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from stratagem import environ
from stratagem.cluster import Cluster, resolve_cluster
from stratagem.cluster.rendezvous import agent_store_prefix
from stratagem.cluster.release import release_store
from stratagem.collective.cross_worker import CrossWorker
from stratagem.strategies.data_parallel.gather import from_bytes, to_bytes
from stratagem.data.files import FileDataset
from stratagem.data.split import batch_size_of, split_sizes
from stratagem.data import worker_shards
from stratagem.errors import InputError
from stratagem.shm import eligibility
from stratagem.strategies.multi_worker.across import AcrossWorkers, choose_backend
from stratagem.strategies.base import _check_iterable
from stratagem.strategies.data_parallel.batch_norm import check_batch_norm_mode
from stratagem.strategies.data_parallel.combine import choose_local_combine
from stratagem.strategies.data_parallel.placement import nccl_available, place_replicas
from stratagem.strategies.data_parallel.mirrored_replicas import MirroredReplicas
from stratagem.strategies.multi_worker.input import InputSharding, MultiWorkerDataset, _rank
from stratagem.strategies.data_parallel.replica_set import ReplicaSet
from stratagem.strategies.data_parallel.replicated import ReplicatedStrategy, check_timeout
from stratagem.strategies.multi_worker.devices import default_local_devices, ranks_sharing_a_gpu, start_process_group
from stratagem.values import flatten

logger = logging.getLogger(__name__)

SHARD_POLICIES = ("auto", "file", "data", "off")


class MultiWorkerMirroredStrategy(ReplicatedStrategy):
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

    Example:
        >>> strategy = sg.MultiWorkerMirroredStrategy()       # under `stratagem launch --workers 2`
        >>> model, optimizer = strategy.distribute(Net(), torch.optim.SGD(...))
        >>> for x, y in strategy.distribute_dataset(loader):   # every worker iterates the same global batches
        ...     strategy.run(train_step, args=(x, y))
    """

    # Parts, in the order a step meets them (each reports its own decisions to explain()):
    #   placement   mirrored_placement.place_replicas: this worker's devices (worker_devices.py: the GPU of
    #               its local rank by default), memory limits, threads
    #   replicas    mirrored_replicas.MirroredReplicas: a copy per local device and their optimizer
    #   combine     combine.choose_local_combine: the local replicas first (several per worker)
    #   the set     replica_set.ReplicaSet: replica threads and barrier, run's weights, BatchNorm statistics
    #               (summed across workers), empty slices, declared loss weights, accumulation
    #   across      across_workers.AcrossWorkers: the chief's values broadcast; gradients summed across
    #               workers (buckets overlapping backward, or after the local combination)
    #   input       multi_worker_input.InputSharding / MultiWorkerDataset: each worker's part of the batches

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
        registry: Any = None,
    ) -> None:
        env = environ.current()
        eligibility.check_wanted(shared_memory, env)  # STRATAGEM_SHARED_MEMORY=0 against shared_memory=True
        mode = check_batch_norm_mode(batch_norm)
        timeout = check_timeout(timeout)
        self._timeout = timeout
        self._cluster = resolve_cluster(cluster, env=env)
        local_decision = None
        if devices is None:
            devices, local_decision = default_local_devices(self._cluster, env, registry)
        placement = place_replicas(
            devices,
            require_gpu=False,
            registry=registry,
            intra_op_threads=intra_op_threads,
            devices_decision=local_decision,
        )
        self._devices = placement.devices
        backend, why = choose_backend(self._devices)
        self._backend = backend
        if self._cluster.master_addr in ("127.0.0.1", "localhost"):
            # Gloo otherwise binds the address the host name resolves to; a local cluster stays on loopback.
            environ.set_default("GLOO_SOCKET_IFNAME", "lo")
        agent_store = agent_store_prefix(self._cluster, env)
        # torchrun's agent owns the store, so nobody's leaving can free it: close() must not wait for that.
        self._store_owned = agent_store is None
        store = start_process_group(
            self._cluster,
            self._devices,
            backend,
            timeout,
            token=env.get("STRATAGEM_CLUSTER_TOKEN"),
            agent_store=agent_store,
        )
        self._cuda_visible_devices = env.get("CUDA_VISIBLE_DEVICES")
        world = self._cluster.world_size
        self._cw = CrossWorker(
            store,
            rank=_rank(self._cluster),
            task_names=[self._cluster.task_for_rank(r) for r in range(world)],
            timeout=timeout,
            device_collectives=backend == "nccl",  # the host does not wait for GPU collectives: a watchdog does
        )
        self._across = AcrossWorkers(
            self._cw,
            self._cluster,
            self._devices,
            backend,
            why,
            bucket_bytes=int(bucket_mb * 1024 * 1024),
            first_bucket_bytes=int(first_bucket_mb * 1024 * 1024),
        )
        self._input_sharding = InputSharding()
        first_replica = _rank(self._cluster) * len(self._devices)  # seeds each GPU replica's random stream
        self._replicas = ReplicaSet(
            self,
            placement,
            build=MirroredReplicas(share_parameters, first_replica),
            combine=choose_local_combine(self._devices, nccl_available=nccl_available(self._devices)),
            across=self._across,
            batch_norm=mode,
            timeout=timeout,
        )
        self._closed = False
        # A script that never calls close() still frees the process group while Python is alive (see close).
        atexit.register(_close_at_exit, weakref.ref(self))
        self._check_same_local_replicas()
        self._across.connect_shared_memory(shared_memory)
        self._gathers = 0

    # ---- placement ----------------------------------------------------------------------------
    def _check_same_local_replicas(self) -> None:
        mine = (
            len(self._devices),
            socket.gethostname(),
            self._cuda_visible_devices,
            sorted({d.index for d in self._devices if d.type == "cuda"}),
        )
        gathered: list[Any] = [None] * self._cluster.world_size
        dist.all_gather_object(gathered, mine)
        counts = [g[0] for g in gathered]
        if len(set(counts)) != 1:
            detail = ", ".join(f"{self._cw.task_names[r]}: {c}" for r, c in enumerate(counts))
            raise InputError(
                f"Every worker must hold the same number of local replicas. Received: {detail}. "
                "Give every worker the same devices= (stratagem launch --devices-per-worker K)."
            )
        shared = ranks_sharing_a_gpu([(g[1], g[2], g[3]) for g in gathered])
        if shared is not None:
            (a, b), gpu = shared
            raise InputError(
                f"Two workers on one machine use the same GPU: {self._cw.task_names[a]} (rank {a}) and "
                f"{self._cw.task_names[b]} (rank {b}) both hold cuda:{gpu}. Received: devices "
                f"{[str(d) for d in self._devices]} on this worker. Leave devices= unset (one GPU per local "
                "rank), or give each worker on a machine its own GPUs."
            )

    @property
    def cluster(self) -> Cluster:
        return self._cluster

    def input_pipeline(self) -> tuple[int, int]:
        return self._cluster.world_size, _rank(self._cluster)

    def _cross_worker_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        self._cw.all_reduce_([out], what="reduce", step=self._replicas.step)
        return out

    def _gather_across_workers(self, items: list[Any]) -> list[Any]:
        """Every worker's replicas' contributions, in rank order (rank order is global batch order)."""
        self._gathers += 1
        device = self._devices[0] if self._backend == "nccl" else torch.device("cpu")
        payloads = self._cw.all_gather_bytes(to_bytes(items), what="gather", step=self._gathers, device=device)
        out: list[Any] = []
        for rank, payload in enumerate(payloads):
            out.extend(items if rank == self._cw.rank else from_bytes(payload, self._cw.task_names[rank]))
        return out

    @property
    def is_chief(self) -> bool:
        """True on rank 0, the worker that writes checkpoints and reports."""
        return self._cluster.is_chief

    def _distribute_step_inputs(self, inputs: Any) -> Any:
        """This worker's part of the global batch given to a `step` function, cut among its replicas.

        Every worker calls the step with the same global batch (the same loader, seeded alike), as
        `distribute_dataset(shard="data")` assumes.
        """
        if not any(isinstance(leaf, torch.Tensor) for leaf in flatten(inputs)):
            return inputs
        size = batch_size_of(inputs)
        if size == 0:
            raise InputError(
                "The global batch given to the step function holds no examples. Received: 0 examples. "
                "Skip empty batches before calling it."
            )
        return MultiWorkerDataset(self, (), "data")._distribute(inputs, size, self._replicas.step)

    # ---- input --------------------------------------------------------------------------------
    def distribute_dataset(self, dataset: Iterable[Any], shard: str = "auto") -> MultiWorkerDataset:  # type: ignore[override]
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
        """
        _check_iterable(dataset, "distribute_dataset")
        if shard not in SHARD_POLICIES:
            raise InputError(f"Unknown shard policy. Received: shard={shard!r}. Use one of {SHARD_POLICIES}.")
        world, rank = self._cluster.world_size, _rank(self._cluster)
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
            return MultiWorkerDataset(self, dataset, "off")
        if shard == "data":
            dataset = self.shard_input(dataset)
        return MultiWorkerDataset(self, dataset, shard, on_first_batch=self._observe_input_sharding)

    def shard_input(self, data: Any, *, note: bool = True) -> Any:
        """`data` cut at the index level for this worker where it can be (data/worker_shards.py), else as it is.

        `fit` calls it on its data before wrapping it, since what reaches `distribute_dataset` there is a generator.
        """
        local = len(self._devices)
        worker = worker_shards.WorkerRange(self.num_replicas_in_sync, _rank(self._cluster) * local, local)
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
        """Stops the replica threads and frees the process group, whose Gloo threads then end. Runs by itself
        at exit: a Gloo thread still running when the interpreter shuts down aborts the process if it
        releases a finished collective then (SIGABRT after a successful run)."""
        self._close(release=True)

    def _close(self, release: bool) -> None:
        """`release`: hand the rendezvous store back (see cluster/release.py), so that a strategy can be built
        again at the same address; not needed at exit, where a worker that already died would only delay it."""
        if getattr(self, "_closed", True):
            return  # closed already (or never built): the process group now may be another strategy's
        self._closed = True
        super().close()
        cw = self._cw
        cw.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        store, cw.store = cw.store, None
        # Closing while an exception propagates (a `finally:` after a worker died): the others may never say
        # they are done, so the handshake would only hold this one up for `timeout`; the store just goes.
        if release and store is not None and sys.exc_info()[0] is None:
            release_store(
                store,
                rank=cw.rank,
                task_names=cw.task_names,
                timeout=self._timeout,
                owned=getattr(self, "_store_owned", True),
            )
        del store  # the chief's store stops listening with its last reference


def _close_at_exit(ref: weakref.ref[MultiWorkerMirroredStrategy]) -> None:
    strategy = ref()
    if strategy is not None:
        strategy._close(release=False)
