"""MirroredStrategy: one process, one persistent model replica per device, synchronous updates.

Each replica keeps its own copy of the model and optimizer; `run` executes the step function
once per replica, in parallel threads (replica 0 on the caller's thread). When a replica's
`loss.backward()` finishes, the replicas meet and combine their gradients, each weighted by
the replica's share of the global batch, so by the time `backward()` returns every replica
holds the gradient of the mean loss over the whole global batch. Clipping and the optimizer
then see the same combined gradient on every replica and apply the same update.

The class assembles parts, each a module of its own (the "parts" comment in MirroredStrategy lists
them in order); CentralStorageStrategy, MultiWorkerMirroredStrategy and OneDeviceStrategy build on it
through the thin methods and empty hooks it keeps here.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stratagem import devices as sg_devices
from stratagem import diagnose  # noqa: F401  (reached as mirrored.diagnose, as before the placement moved)
from stratagem.collective.local import InMemoryReduce, LocalReducer, choose_local_reducer
from stratagem.diagnose import PlacementDecision
from stratagem.diagnose.placement import capture_placement
from stratagem.diagnose.soft_placement import as_placement_error
from stratagem.errors import InputError
from stratagem.strategies.accumulation import LocalAccumulation
from stratagem.strategies import loss_weight
from stratagem.strategies import cuda_numerics
from stratagem.strategies.base import Strategy
from stratagem.strategies.batch_norm import BatchNormSync, CrossWorkerSum, batch_norm_decision, check_batch_norm_mode
from stratagem.strategies.combine import LocalCombination
from stratagem.strategies.compiled import make_room_for_replicas
from stratagem.strategies import run_inputs
from stratagem.strategies.distributed import DistributedModel, check_optimizer_supported
from stratagem.strategies.empty_slices import RULE as EMPTY_SLICE_RULE
from stratagem.strategies.empty_slices import EmptySlices
from stratagem.strategies.explain import Explanation, ReplicaPlacement
from stratagem.strategies import mirrored_placement as placement
from stratagem.strategies.mirrored_placement import nccl_available as _nccl_available
from stratagem.strategies.profiling import warn_if_profiling_one_thread
from stratagem.strategies.replicas import ReplicaBarrier, ReplicaContext, ReplicaPool
from stratagem.strategies.replicas import current_replica_context, enter_replica
from stratagem.strategies.mirrored_replicas import distribute_optimizer, make_replicas
from stratagem.values import select_replica, stack_replicas

logger = logging.getLogger(__name__)


@dataclass
class _RunState:
    step: int
    weights: list[float]
    counts: list[float | None] | None = None
    """Loss weights declared with sg.set_loss_weight in this step (None: weighting by examples)."""


STEAL_MIN_ELEMENTS = 64 * 1024
"""A replica waiting at the end of backward combines early only shares of at least this many elements."""


class MirroredStrategy(Strategy):
    """Synchronous data parallelism over the devices of one process (tf.distribute.MirroredStrategy).

    Args:
        devices: device names in TF or torch spelling (`["/gpu:0", "cuda:1"]`, `["cpu:0", "cpu:1"]`).
            None: every visible GPU, or the CPU when there is none (and `explain()` says why).
        require_gpu: raise `GpuUnavailableError`, with the diagnosis, instead of running on the CPU.
        timeout: seconds any replica waits for the others before failing with an error naming them.
        intra_op_threads: torch intra-op threads per CPU replica (default: the process's threads
            shared evenly among the CPU replicas, at least one each).
        share_parameters: when every replica is on one physical device (logical CPU devices), keep
            one copy of the parameters and optimizer state, each replica updating 1/N of it
            (None: whenever the optimizer allows it; False: a private copy per replica).
        batch_norm: "global" (default): BatchNorm layers normalise with the statistics of the whole
            global batch, forward and backward, as on one device, and every replica keeps the same
            running statistics; "per_replica": each replica's own slice (TensorFlow's default, cheaper).

    Example:
        >>> strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> model, optimizer = strategy.distribute(Net(), torch.optim.SGD(net.parameters(), lr=0.1))
        >>> for x, y in strategy.distribute_dataset(loader):
        ...     losses = strategy.run(train_step, args=(x, y))
        ...     print(strategy.reduce("mean", losses))
    """

    # Parts, in the order a step meets them (each module owns one idea and reports its decisions):
    #  1. placement: devices, one replica per GPU, memory limits and check, intra-op threads, parameter
    #     sharing (mirrored_placement.py); the local reducer (collective/local.py)
    #  2. replicas: a model copy per device and their optimizer (mirrored_replicas.py, sharded.py,
    #     distributed.py), run on threads meeting at a barrier (replicas.py); compiled models
    #     (compiled.py), CUDA random streams and TF32 (cuda_numerics.py)
    #  3. run's inputs: slice sizes and each replica's weight (run_inputs.py); empty slices (empty_slices.py)
    #  4. BatchNorm statistics across replicas (batch_norm.py)
    #  5. end of backward: the local combination and its work stealing (combine.py), then the sum across
    #     workers (the _combine_across_workers hook: multi_worker.py); declared loss weights (loss_weight.py)
    #  6. accumulation under no_sync() (accumulation.py); schedulers built before distribute (lr_schedulers.py)
    #  7. explain() gathers every part's decisions (explain.py); run() warns when a profiler would see
    #     only replica 0's thread (profiling.py)

    def __init__(
        self,
        devices: Sequence[str | torch.device] | None = None,
        *,
        require_gpu: bool = False,
        timeout: float = 300.0,
        intra_op_threads: int | None = None,
        share_parameters: bool | None = None,
        batch_norm: str = "global",
        registry: sg_devices.DeviceRegistry | None = None,
    ) -> None:
        self._share_parameters = share_parameters
        self._batch_norm_mode = check_batch_norm_mode(batch_norm)
        if timeout <= 0:
            raise InputError(f"timeout must be a positive number of seconds. Received: timeout={timeout!r}.")
        self._timeout = float(timeout)
        self._decisions: list[PlacementDecision] = []
        logical = self._choose_devices(devices, require_gpu, registry)
        self._logical = logical
        self._devices = [d.physical for d in logical]
        self._names = [d.name for d in logical]
        self._check_one_replica_per_gpu()
        for choice, why in sg_devices.enforce_memory_limits(logical):
            self._decisions.append(PlacementDecision(subject="GPU memory limit", choice=choice, reason=why))
        facts = self._facts if hasattr(self, "_facts") else None
        nccl = bool(facts.nccl_available) if facts is not None else _nccl_available(self._devices)
        self._reducer: LocalReducer
        self._reducer, decision = choose_local_reducer(self._devices, nccl_available=nccl)
        if len(self._devices) > 1:
            self._decisions.append(decision)
        self._threads_per_replica = self._choose_threads(intra_op_threads)
        self._pool: ReplicaPool | None = None
        self._barrier = ReplicaBarrier(self._names, self._timeout)
        self._model: DistributedModel | None = None
        self._replica_params: list[list[nn.Parameter]] = []
        self._queued = [False] * len(self._devices)
        self._combination = LocalCombination(self._barrier, len(self._devices))
        self._run_state: _RunState | None = None
        self._step = 0
        self._empty_slices = EmptySlices()
        self._batch_norm: BatchNormSync | None = None
        if self.num_replicas_in_sync > 1:
            self._decisions.append(batch_norm_decision(self._batch_norm_mode))
        self._accumulation = LocalAccumulation()

    # ---- placement ----------------------------------------------------------------------------
    # Each decision is made in strategies/mirrored_placement.py; these thin methods record it.
    def _choose_devices(self, devices, require_gpu, registry) -> list[sg_devices.LogicalDevice]:
        chosen, decision = placement.choose_devices(devices, require_gpu, registry)
        self._decisions.append(decision)
        return chosen

    def _check_one_replica_per_gpu(self) -> None:
        placement.check_one_replica_per_gpu(self._devices, self._names)

    def _choose_threads(self, intra_op_threads: int | None) -> int | None:
        threads, decision = placement.choose_threads(self._devices, intra_op_threads)
        if decision is not None:
            self._decisions.append(decision)
        return threads

    @property
    def _local_devices(self) -> list[torch.device]:
        return self._devices

    def _num_local_replicas(self) -> int:
        return len(self._devices)

    def explain(self) -> Explanation:
        replicas = [ReplicaPlacement(r, name, str(dev)) for r, (name, dev) in enumerate(zip(self._names, self._devices))]
        details: dict[str, Any] = {}
        if len(self._devices) > 1:
            details["gradient weighting"] = ("each replica's gradient weighted by its share of the global batch, or by "
                                             "the loss weight its step declares (sg.set_loss_weight)")
        details.update(self._explain_parts())
        decisions = list(self._decisions)
        tf32 = cuda_numerics.tf32_decision(self._devices)  # read now: the switches are the user's to flip
        if tf32 is not None:
            decisions.append(tf32)
        return Explanation(type(self).__name__, self.num_replicas_in_sync, replicas, decisions, details)

    def _first_global_replica(self) -> int:
        """The global index of this process's first replica (0 in one process)."""
        return 0

    # ---- distribute ---------------------------------------------------------------------------
    def distribute(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
        self._check_distribute_args(model, optimizer, self._model)
        check_optimizer_supported(optimizer, self.num_replicas_in_sync, type(self).__name__)
        self._check_memory(model, optimizer)
        self._note_compiled(model)
        streams = cuda_numerics.seed_replica_streams(self._devices, self._first_global_replica())
        if streams is not None:
            self._decisions.append(streams)
        source_params = list(model.parameters())
        shared = self._decide_sharing(model, optimizer)
        replicas = make_replicas(model, self._devices, shared)
        distributed_optimizer = None
        if optimizer is not None:
            distributed_optimizer = distribute_optimizer(
                optimizer, source_params, replicas, self._devices[0], shared, self)
        self._replica_params = [[p for p in r.parameters() if p.requires_grad] for r in replicas]
        plain = getattr(distributed_optimizer, "_optimizers", None) or ([optimizer] if optimizer is not None else [])
        self._accumulation.attach(self._replica_params, plain)
        self._prepare_replicas(replicas)
        self._install_batch_norm(replicas)
        # A share of a small gradient costs more in Python calls than it saves; those are combined after
        # the meeting, all in one call (a model of 300 small layers ran 30-50% slower stealing them all).
        steal = isinstance(self._reducer, InMemoryReduce) and len(replicas) > 1
        self._combination.attach(self._replica_params, steal, STEAL_MIN_ELEMENTS)
        if self._needs_gradient_sync():
            for r, params in enumerate(self._replica_params):
                for i, p in enumerate(params):
                    p.register_post_accumulate_grad_hook(self._make_grad_hook(r, i))
        if len(replicas) == 1:
            self._model = model  # type: ignore[assignment]
            return model if optimizer is None else (model, optimizer)
        self._pool = ReplicaPool(self._names, self._setup_replica_thread, self._timeout)
        distributed = DistributedModel(replicas, self)
        self._model = distributed
        if optimizer is None:
            return distributed
        return distributed, distributed_optimizer

    def _note_compiled(self, model: nn.Module) -> None:
        """A model compiled before distribute: room in torch.compile's cache for every replica (strategies/compiled.py)."""
        decision = make_room_for_replicas(model, len(self._devices))
        if decision is not None:
            self._decisions.append(decision)

    def _check_memory(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Before anything is copied: does each GPU replica have room for the model's training state?"""
        placement.check_memory(self._logical, model, optimizer)

    def _decide_sharing(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
        """Whether the replicas share one copy of the parameters (see strategies/sharded.py)."""
        shared, decision = placement.decide_sharing(self._devices, self._share_parameters, model, optimizer)
        if decision is not None:
            self._decisions.append(decision)
        return shared

    def _current_replica(self) -> int | None:
        ctx = current_replica_context()
        if ctx is None or ctx.strategy is not self:
            return None
        return ctx.replica_id_in_sync_group

    def _after_optimizer_step(self, replica: int) -> None:
        self._meet(replica, "optimizer step")

    def _meet(self, replica: int, what: str) -> None:
        """Inside a step, this process's replicas wait for each other at `what` (an optimizer or scheduler step)."""
        state = self._run_state
        if state is not None:
            self._barrier.wait(replica, what, state.step)

    # ---- run ----------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """Runs `fn` once per replica, in parallel, each with its slice of the distributed inputs.

        Returns the per-replica results (`PerReplica` leaves; the plain result with one replica).
        An exception in any replica stops the others and is re-raised here.
        """
        if not callable(fn):
            raise InputError(f"run() needs a function to call once per replica. Received: {type(fn).__name__}.")
        kwargs = dict(kwargs or {})
        args = tuple(args)
        num_replicas = len(self._devices)
        batch_sizes = run_inputs.batch_sizes(args, kwargs, num_replicas)
        global_size = run_inputs.global_size(args, kwargs)
        self._step += 1
        self._run_state = state = _RunState(self._step, self._replica_weights(batch_sizes, global_size))
        self._begin_parts(batch_sizes)
        self._queued = [False] * num_replicas
        self._combination.begin_run()
        self._accumulation.begin_run(self._run_state.weights, self._step)
        self._begin_step(self._run_state)
        if num_replicas == 1:
            try:
                result = self._run_one(fn, args, kwargs)
            finally:
                self._run_state = None
                self._accumulation.end_run()
            if self.num_replicas_in_sync == 1:
                return result
            return loss_weight.tag_results(stack_replicas([result], batch_sizes, global_size), state.counts)
        if self._pool is None:
            self._pool = ReplicaPool(self._names, self._setup_replica_thread, self._timeout)
        self._barrier.reset()
        self._combination.reset(self._replica_params)
        self._combination.stealing = self._combination.steal and capture_placement() is None
        grad_enabled = torch.is_grad_enabled()
        warn_if_profiling_one_thread(self, num_replicas)

        def job(replica: int) -> Any:
            previous = enter_replica(ReplicaContext(replica, self.num_replicas_in_sync, self._devices[replica], self))
            try:
                with torch.set_grad_enabled(grad_enabled), run_inputs.device_guard(self._devices[replica]):
                    return fn(*select_replica(args, replica), **select_replica(kwargs, replica))
            except BaseException as error:
                self._barrier.abort(error)  # before finish(): waiting replicas must see the cause, not an early exit
                raise
            finally:
                enter_replica(previous)
                self._barrier.finish(replica)

        caller_threads = torch.get_num_threads()
        if self._threads_per_replica is not None and self._devices[0].type == "cpu":
            torch.set_num_threads(self._threads_per_replica)
        try:
            results = self._pool.run(job, on_error=self._barrier.abort)
        finally:
            if torch.get_num_threads() != caller_threads:
                torch.set_num_threads(caller_threads)
            self._run_state = None
            self._accumulation.end_run()
        return loss_weight.tag_results(stack_replicas(results, batch_sizes, global_size), state.counts)

    def _replica_weights(self, batch_sizes: tuple[int, ...] | None, global_size: int | None) -> list[float]:
        """Each local replica's share of the global batch (equal shares when the batch is unknown)."""
        return run_inputs.replica_weights(batch_sizes, global_size, len(self._devices), self.num_replicas_in_sync)

    def _begin_step(self, state: _RunState) -> None:
        """Called at the start of each run (multi-worker: heartbeat, bucket reset)."""

    def _run_one(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        previous = enter_replica(ReplicaContext(0, self.num_replicas_in_sync, self._devices[0], self))
        try:
            with run_inputs.device_guard(self._devices[0]):
                return fn(*select_replica(args, 0), **select_replica(kwargs, 0))
        except NotImplementedError as error:
            translated = as_placement_error(error)  # torch's "Could not run ... backend", with the fix
            if translated is None:
                raise
            raise translated from error
        finally:
            enter_replica(previous)

    def _setup_replica_thread(self, replica: int) -> None:
        device = self._devices[replica]
        if device.type == "cpu" and self._threads_per_replica is not None:
            torch.set_num_threads(self._threads_per_replica)
        elif device.type == "cuda":
            torch.cuda.set_device(device)

    # ---- gradient combination at the end of backward -------------------------------------------
    def _needs_gradient_sync(self) -> bool:
        """Whether replicas must combine gradients at the end of backward."""
        return len(self._devices) > 1

    def _prepare_replicas(self, replicas: list[nn.Module]) -> None:
        """Called once the replicas exist, before hooks are registered (multi-worker: broadcast, buckets)."""

    def _grad_ready(self, replica: int, index: int) -> None:
        """Called as soon as gradient `index` of `replica` has been accumulated (multi-worker: buckets)."""

    def _make_grad_hook(self, replica: int, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if self._accumulation.active and self._accumulation.skips(replica):
                return  # inside no_sync(): this replica's gradient only accumulates (strategies/accumulation.py)
            self._combination.grad_ready(replica, index)  # a replica waiting may combine this one now
            self._grad_ready(replica, index)
            if not self._queued[replica]:
                self._queued[replica] = True
                # Runs once when this backward pass has finished, before backward() returns.
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self._on_backward_end(replica))

        return hook

    def _on_backward_end(self, replica: int) -> None:
        self._queued[replica] = False
        state = self._run_state
        # Not the thread-local replica context: on a GPU this callback runs on torch's autograd thread
        # for that device, not on the replica's own thread.
        if state is None:
            raise InputError(
                "backward() ran on a distributed model outside strategy.run(), so the replicas cannot combine "
                "their gradients and would drift apart. Call loss.backward() inside the function given to "
                "strategy.run()."
            )
        lists = self._combination.combine(replica, self._replica_params, self._reducer, state.weights, state.step)
        # Not only when this worker has gradients: the others may, and every worker must join the sum.
        if self._combine_across_workers(replica, lists, state.step):
            self._barrier.wait(replica, "gradient combination across workers", state.step)
        self._apply_loss_weights(replica, state)

    # ---- losses weighted by declared counts (strategies/loss_weight.py) ---------------------------
    def _declare_loss_weight(self, replica: int, count: float) -> None:
        state = self._run_state
        if state is not None:
            loss_weight.declare(state, replica, count, len(self._devices))
            self._loss_weight_declared(replica, count)

    def _loss_weight_declared(self, replica: int, count: float) -> None:
        """Called when `replica` declares its count, before its backward pass (multi-worker: the buckets' weight)."""

    def _loss_weight_total(self, state: _RunState) -> float | None:
        """The count the combined gradients are divided by (None: weighted by examples, nothing to divide)."""
        total, declared = loss_weight.local_total(state.counts)
        return loss_weight.check_total(total, declared, len(self._devices), state.step)

    def _apply_loss_weights(self, replica: int, state: _RunState) -> None:
        total = self._loss_weight_total(state)
        if total is not None:
            loss_weight.divide_gradients_(self._replica_params[replica], total)

    @property
    def _claimed(self) -> list[list[int]]:
        """Per gradient, per share: the backward pass in which a waiting replica combined it (strategies/combine.py)."""
        return self._combination.claimed

    @property
    def _stealable(self) -> list[bool]:
        """Per gradient: whether a waiting replica may combine its shares early (strategies/combine.py)."""
        return self._combination.stealable

    def _combine_across_workers(self, replica: int, lists: Any, step: int) -> bool:
        """After the local combination: sum across worker processes. Returns True when it did work
        that the other local replicas must wait for."""
        return False

    def no_sync(self) -> Any:
        """A context in which backward only accumulates each replica's gradients, as DDP's `no_sync`.

        Gradient accumulation over K micro-batches combines once instead of K times: run the first
        K-1 micro-batches inside it and the last one outside; that last backward combines everything
        accumulated, each micro-batch weighted by each replica's share of it, so the result is one
        device's sum of the K gradients. `optimizer.step()` before that last backward is refused.

        Example:
            >>> for i, batch in enumerate(strategy.distribute_dataset(loader)):
            ...     last = i % k == k - 1
            ...     with contextlib.nullcontext() if last else strategy.no_sync():
            ...         strategy.run(micro_step, args=(batch, last))  # steps the optimizer when last
        """
        if not self._needs_gradient_sync():
            return contextlib.nullcontext()  # one replica: backward combines nothing that could be skipped
        return self._accumulation.no_sync(inside_run=self._current_replica() is not None)

    def close(self) -> None:
        """Stops the replica threads (they also stop when the process exits); BatchNorm layers get their own
        forward back."""
        if self._batch_norm is not None:
            self._batch_norm.remove()
        self._accumulation.close()
        if self._pool is not None:
            self._pool.close()
            self._pool = None


    # ---- parts: BatchNorm statistics (batch_norm.py) and empty slices (empty_slices.py) ----------
    def _install_batch_norm(self, replicas: list[nn.Module]) -> None:
        """Once the replicas exist: their BatchNorm layers exchange statistics as `batch_norm=` says."""
        self._batch_norm = BatchNormSync(
            self._batch_norm_mode, strategy=self, barrier=self._barrier, num_local=len(replicas),
            num_replicas_in_sync=self.num_replicas_in_sync, weight=self._replica_weight, step=lambda: self._step,
            cross_worker_sum=self._batch_norm_cross_worker())
        self._batch_norm.install(replicas)

    def _batch_norm_cross_worker(self) -> CrossWorkerSum | None:
        """How BatchNorm sums cross worker processes (None: one process)."""
        return None

    def _replica_weight(self, replica: int) -> float | None:
        state = self._run_state
        return None if state is None else state.weights[replica]

    def _begin_parts(self, batch_sizes: tuple[int, ...] | None) -> None:
        self._empty_slices.begin_step(batch_sizes)
        if self._batch_norm is not None:
            self._batch_norm.begin_step()

    def _call_replica(self, model: nn.Module, args: tuple, kwargs: dict) -> Any:
        """The distributed model's call on the running replica (a stand-in on an empty slice)."""
        return self._empty_slices.call(model, self._current_replica(), args, kwargs)

    def _explain_parts(self) -> dict[str, str]:
        if self.num_replicas_in_sync == 1:
            return {}
        details = {"empty slices": EMPTY_SLICE_RULE}
        if self._batch_norm is not None:
            details.update(self._batch_norm.describe())
        return details
