"""MultiWorkerMirroredStrategy: synchronous data parallelism across worker processes.

Each worker process holds one replica per local device, exactly as MirroredStrategy does;
across processes gradients are summed with `torch.distributed` (Gloo on CPU, NCCL on GPU), or,
when every worker runs on this host, through shared memory (`stratagem.collective.shared_memory`).
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
from torch import nn

from stratagem import environ
from stratagem.cluster import Cluster, allocator, resolve_cluster
from stratagem.cluster.rendezvous import agent_store_prefix
from stratagem.cluster.release import release_store
from stratagem.collective.buckets import GradientBuckets
from stratagem.collective.worker_sum import sum_gradients_across_workers
from stratagem.collective.cross_worker import CrossWorker
from stratagem.strategies.gather import from_bytes, to_bytes
from stratagem.data.files import FileDataset
from stratagem.data.split import batch_size_of, split_sizes
from stratagem.data import worker_shards
from stratagem.diagnose import PlacementDecision
from stratagem.errors import InputError
from stratagem.strategies import loss_weight
from stratagem.strategies.base import _check_iterable
from stratagem.strategies.explain import Explanation
from stratagem.strategies.mirrored import MirroredStrategy, _RunState
from stratagem.strategies.multi_worker_input import MultiWorkerDataset, _rank
from stratagem.strategies.worker_devices import default_local_devices, ranks_sharing_a_gpu, start_process_group
from stratagem.values import flatten

logger = logging.getLogger(__name__)

SHARD_POLICIES = ("auto", "file", "data", "off")


class MultiWorkerMirroredStrategy(MirroredStrategy):
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
        self._cluster = resolve_cluster(cluster, env=env)
        local_decision = None
        if devices is None:
            devices, local_decision = default_local_devices(self._cluster, env, registry)
        super().__init__(devices, timeout=timeout, intra_op_threads=intra_op_threads,
                         share_parameters=share_parameters, batch_norm=batch_norm, registry=registry)
        if local_decision is not None:
            self._decisions = [d for d in self._decisions if d.subject != "devices"] + [local_decision]
        self._bucket_bytes = int(bucket_mb * 1024 * 1024)
        self._first_bucket_bytes = int(first_bucket_mb * 1024 * 1024)
        backend, why = self._choose_backend()
        self._backend = backend
        self._decisions.append(PlacementDecision(subject="cross-worker backend", choice=backend, reason=why))
        if self._cluster.master_addr in ("127.0.0.1", "localhost"):
            # Gloo otherwise binds the address the host name resolves to; a local cluster stays on loopback.
            environ.set_default("GLOO_SOCKET_IFNAME", "lo")
        agent_store = agent_store_prefix(self._cluster, env)
        # torchrun's agent owns the store, so nobody's leaving can free it: close() must not wait for that.
        self._store_owned = agent_store is None
        store = start_process_group(self._cluster, self._devices, backend, timeout,
                                    token=env.get("STRATAGEM_CLUSTER_TOKEN"), agent_store=agent_store)
        self._cuda_visible_devices = env.get("CUDA_VISIBLE_DEVICES")
        self._closed = False
        world = self._cluster.world_size
        self._cw = CrossWorker(
            store,
            rank=_rank(self._cluster),
            task_names=[self._cluster.task_for_rank(r) for r in range(world)],
            timeout=timeout,
        )
        # A script that never calls close() still frees the process group while Python is alive (see close).
        atexit.register(_close_at_exit, weakref.ref(self))
        self._check_same_local_replicas()
        self._connect_shared_memory(shared_memory)
        self._buckets: GradientBuckets | None = None
        self._gathers = 0
        self._weights_across_workers: tuple[float, int] = (0.0, 0)

    # ---- placement ----------------------------------------------------------------------------
    def _choose_backend(self) -> tuple[str, str]:
        if all(d.type == "cuda" for d in self._devices) and dist.is_nccl_available():
            return "nccl", "every local replica is on a GPU and torch has NCCL"
        if all(d.type == "cuda" for d in self._devices):
            return "gloo", "torch was built without NCCL, so GPU gradients cross workers through Gloo (slower)"
        return "gloo", "the replicas are on the CPU, where torch.distributed uses Gloo"

    def _check_same_local_replicas(self) -> None:
        mine = (len(self._devices), socket.gethostname(), self._cuda_visible_devices,
                sorted({d.index for d in self._devices if d.type == "cuda"}))
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

    def _connect_shared_memory(self, wanted: bool | None) -> None:
        if self._backend == "nccl":
            if wanted:
                raise InputError("shared_memory=True sums CPU tensors, but this worker's replicas are on GPUs, which "
                                 f"use NCCL. Received: devices {[str(d) for d in self._devices]}. Leave shared_memory "
                                 "unset for GPUs.")
            return
        on_cpu = all(d.type == "cpu" for d in self._devices)
        why, fell_back = self._cw.connect_shared_memory(
            wanted=wanted is not False, why_not=None if on_cpu else "the replicas are on GPUs without NCCL")
        if wanted and self._cw.shared is None:
            raise InputError(f"shared_memory=True, but the workers cannot sum through shared memory. Received: {why}. "
                             "Leave shared_memory unset to use Gloo in that case.")
        if fell_back and self._cluster.rank == 0:
            logger.warning("Every worker runs on this host, but gradients cross workers through Gloo's loopback TCP, "
                           "which is slower than shared memory: %s. Fix: make room in /dev/shm (a container's "
                           "--shm-size), or pass shared_memory=False to keep Gloo without this warning.", why)
        choice = "shared memory" if self._cw.shared is not None else "gloo"
        self._decisions.append(PlacementDecision(subject="cross-worker sums", choice=choice, reason=why))

    @property
    def cluster(self) -> Cluster:
        return self._cluster

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self._devices) * self._cluster.world_size

    def _first_global_replica(self) -> int:
        return _rank(self._cluster) * len(self._devices)

    def input_pipeline(self) -> tuple[int, int]:
        return self._cluster.world_size, _rank(self._cluster)

    def _needs_gradient_sync(self) -> bool:
        return True

    def explain(self) -> Explanation:
        base = super().explain()
        details = dict(base.details)
        details["cluster"] = f"{self._cluster.task_name}, rank {self._cluster.rank} of {self._cluster.world_size} (from {self._cluster.source})"
        if self._buckets is not None:
            details["gradient buckets (MiB, in launch order)"] = self._buckets.describe()
        details["gradient weighting"] = ("each replica's gradient weighted by its share of the global batch across all "
                                         "workers, or by the loss weight its step declares (sg.set_loss_weight)")
        memory, why = allocator.describe(environ.current())
        decisions = [*base.decisions, PlacementDecision(subject="freed host memory", choice=memory, reason=why)]
        return Explanation(type(self).__name__, self.num_replicas_in_sync, base.replicas, decisions, details)

    # ---- distribute ---------------------------------------------------------------------------
    def _prepare_replicas(self, replicas: list[nn.Module]) -> None:
        self._check_same_model(replicas[0])
        self._broadcast_from_chief(replicas)
        if len(replicas) == 1:
            self._buckets = GradientBuckets(
                self._replica_params[0], bucket_bytes=self._bucket_bytes, first_bucket_bytes=self._first_bucket_bytes,
                count_users=True,  # a parameter no worker used keeps grad None, as on one device
            )

    def _check_same_model(self, model: nn.Module) -> None:
        signature = [(name, tuple(t.shape), str(t.dtype)) for name, t in model.state_dict().items()]
        gathered: list[Any] = [None] * self._cluster.world_size
        dist.all_gather_object(gathered, signature)
        chief = gathered[0]
        for rank, theirs in enumerate(gathered[1:], start=1):
            if theirs == chief:
                continue
            who = self._cw.task_names[rank]
            for (name_c, shape_c, dtype_c), (name_t, shape_t, dtype_t) in zip(chief, theirs):
                if (name_c, shape_c, dtype_c) != (name_t, shape_t, dtype_t):
                    raise InputError(
                        f"The workers' models differ: {who} has '{name_t}' of shape {shape_t} ({dtype_t}) where the "
                        f"chief ({self._cw.task_names[0]}) has '{name_c}' of shape {shape_c} ({dtype_c}). Every worker "
                        "must build the same model before strategy.distribute()."
                    )
            raise InputError(
                f"The workers' models differ: {who} has {len(theirs)} parameters and buffers, the chief has "
                f"{len(chief)}. Every worker must build the same model before strategy.distribute()."
            )

    def _broadcast_from_chief(self, replicas: list[nn.Module]) -> None:
        tensors = [t for t in replicas[0].state_dict(keep_vars=True).values()]
        with torch.no_grad():
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for t in tensors:
                by_dtype.setdefault(t.dtype, []).append(t)
            for group in by_dtype.values():
                flat = torch._utils._flatten_dense_tensors([t.detach() for t in group])
                work = dist.broadcast(flat, src=0, async_op=True)
                self._cw.wait([work], what="broadcast of the chief's parameters", step=0)
                for t, value in zip(group, torch._utils._unflatten_dense_tensors(flat, group)):
                    t.detach().copy_(value)
            for replica in replicas[1:]:
                replica.load_state_dict(replicas[0].state_dict())

    # ---- each step ----------------------------------------------------------------------------
    def _begin_step(self, state: _RunState) -> None:
        self._cw.heartbeat(state.step)
        if self._buckets is not None:
            self._buckets.start(state.weights[0])

    def _grad_ready(self, replica: int, index: int) -> None:
        if self._buckets is not None and self._run_state is not None:
            self._buckets.mark_ready(index, self._launch)

    def _launch(self, flat: torch.Tensor) -> Any:
        step = self._run_state.step if self._run_state is not None else self._step
        works = self._cw.all_reduce_async([flat], what="gradient all-reduce", step=step)
        return works[0] if works else None

    def _on_backward_end(self, replica: int) -> None:
        if self._buckets is None:
            super()._on_backward_end(replica)
            return
        self._queued[replica] = False
        state = self._run_state
        if state is None:
            super()._on_backward_end(replica)  # raises the "backward outside run" error
            return
        works = self._buckets.finish(self._launch)
        self._cw.wait(works, what="gradient all-reduce", step=state.step)
        self._buckets.hand_out()
        self._weights_across_workers = self._buckets.declared_total()
        self._apply_loss_weights(replica, state)
        # Ready for a second backward in the same step.
        self._buckets.start(state.weights[0], declared=state.counts is not None)

    def _combine_across_workers(self, replica: int, lists: Any, step: int) -> bool:
        if replica == 0:
            self._sum_across_workers(step)
        return True

    def _sum_across_workers(self, step: int) -> None:
        """Replica 0, after the local combination (see collective/worker_sum.py)."""
        state = self._run_state
        declared = loss_weight.local_total(state.counts if state is not None else None)
        self._weights_across_workers = sum_gradients_across_workers(self._cw, self._replica_params, declared, step)

    def _loss_weight_declared(self, replica: int, count: float) -> None:
        if self._buckets is not None:
            self._buckets.declare_weight(count)

    def _loss_weight_total(self, state: _RunState) -> float | None:
        total, declared = self._weights_across_workers  # summed along with the gradients
        return loss_weight.check_total(total, declared, self.num_replicas_in_sync, state.step)

    def _batch_norm_cross_worker(self) -> Any:
        return lambda tensor, what, step: self._cw.all_reduce_([tensor], what=what, step=step)

    def _cross_worker_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        self._cw.all_reduce_([out], what="reduce", step=self._step)
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
            raise InputError("The global batch given to the step function holds no examples. Received: 0 examples. "
                             "Skip empty batches before calling it.")
        return MultiWorkerDataset(self, (), "data")._distribute(inputs, size, self._step)

    # ---- input --------------------------------------------------------------------------------
    def distribute_dataset(self, dataset: Iterable[Any], shard: str = "auto") -> MultiWorkerDataset:  # type: ignore[override]
        """Distributes a loader across workers and their local replicas.

        shard="data": every worker trains on its contiguous part of the same GLOBAL batches, so the split is
        the one a single process with all replicas would make (exact equivalence). A DataLoader over a
        map-style data set with a batch size (or batch sampler), or a `ShuffledBatches`, is cut at the index
        level: each worker reads only its part of each global batch. Any other input (an IterableDataset, a
        generator, a list of batches) is read whole by every worker, which keeps its part; `explain()`
        says which ("input sharding").
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
                self._note_input_sharding("file", "a FileDataset with at least one file per worker")
        if shard == "file":
            if not isinstance(dataset, FileDataset) or len(dataset.files) < world:
                received = f"{len(dataset.files)} file(s)" if isinstance(dataset, FileDataset) else type(dataset).__name__
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
            self._note_input_sharding(*decision)
        return data

    def _note_input_sharding(self, choice: str, why: str) -> None:
        self._decisions = [d for d in self._decisions if d.subject != "input sharding"]
        self._decisions.append(PlacementDecision(subject="input sharding", choice=choice, reason=why))

    def _observe_input_sharding(self, index_level: bool, dataset: Any) -> None:
        current = next((d.choice for d in self._decisions if d.subject == "input sharding"), None)
        seen = worker_shards.observed_sharding(index_level, dataset, current)
        if seen is not None:
            self._note_input_sharding(*seen)

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
            release_store(store, rank=cw.rank, task_names=cw.task_names, timeout=self._timeout,
                          owned=getattr(self, "_store_owned", True))
        del store  # the chief's store stops listening with its last reference


def _close_at_exit(ref: weakref.ref[MultiWorkerMirroredStrategy]) -> None:
    strategy = ref()
    if strategy is not None:
        strategy._close(release=False)
