"""The data-parallel core: one process's replicas, run in lockstep, and the parts that combine them.

Mirrored, OneDevice, CentralStorage and MultiWorkerMirrored each hold one `ReplicaSet` and differ
only in the parts they give it:

- `placement` (`mirrored_placement.ReplicaDevices`): the devices and their threads;
- `build`: how `distribute` makes the replicas and the optimizer (`mirrored_replicas.MirroredReplicas`:
  a copy per device; `central_update.CentralUpdate`: one central copy, updated once per step);
- `combine` (`combine.LocalCombine`): the reducer of the local combination at the end of backward;
- `across` (`across_workers.AcrossWorkers`, or None in one process): the sum across worker processes.

The set itself owns the replica threads and their barrier, `run`'s inputs and weights, the hook at
the end of each backward pass, BatchNorm statistics, empty slices and accumulation (`no_sync`).
`explain()` collects the decisions of every part from `parts`; no part edits another's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from stratagem.collective.local import InMemoryReduce
from stratagem.diagnose import PlacementDecision
from stratagem.diagnose.placement import capture_placement
from stratagem.diagnose.soft_placement import as_placement_error
from stratagem.errors import InputError
from stratagem.strategies.data_parallel import loss_weight
from stratagem.strategies.data_parallel import run_inputs
from stratagem.strategies.data_parallel.accumulation import LocalAccumulation
from stratagem.strategies.data_parallel.batch_norm import BatchNormSync, batch_norm_decision
from stratagem.strategies.data_parallel.combine import LocalCombination, LocalCombine
from stratagem.strategies.data_parallel.distributed import check_optimizer_supported
from stratagem.strategies.data_parallel.empty_slices import RULE as EMPTY_SLICE_RULE
from stratagem.strategies.data_parallel.empty_slices import EmptySlices
from stratagem.strategies.data_parallel.placement import ReplicaDevices
from stratagem.strategies.data_parallel.profiling import warn_if_profiling_one_thread
from stratagem.strategies.data_parallel.replicas import ReplicaBarrier, ReplicaContext, ReplicaPool
from stratagem.strategies.data_parallel.replicas import current_replica_context, enter_replica
from stratagem.values import select_replica, stack_replicas

logger = logging.getLogger(__name__)

STEAL_MIN_ELEMENTS = 64 * 1024
"""A replica waiting at the end of backward combines early only shares of at least this many elements."""


@dataclass
class RunState:
    """What one `run` knows while its replicas compute."""

    step: int
    weights: list[float]
    counts: list[float | None] | None = None
    """Loss weights declared with sg.set_loss_weight in this step (None: weighting by examples)."""


@dataclass(frozen=True)
class Built:
    """What a `ReplicaBuilder` made of the user's model and optimizer."""

    replicas: list[nn.Module]
    model: nn.Module
    """The model `distribute` returns."""
    optimizer: Any
    """The optimizer `distribute` returns (None without one)."""
    plain_optimizers: list[torch.optim.Optimizer]
    """The torch optimizers that update the replicas (accumulation checks their steps)."""


class ReplicaBuilder(Protocol):
    """The part that makes the replicas at `distribute` and keeps them fed at each step."""

    steal: bool
    """Whether a replica waiting at the end of backward may combine shares of the others' gradients."""
    accumulates: bool
    """Whether `no_sync()` skips the combination (False: every backward pass combines)."""

    def attach(self, replica_set: ReplicaSet) -> None: ...

    def build(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Built: ...

    def begin_step(self) -> None: ...

    def end_run(self) -> None: ...

    def decisions(self) -> list[PlacementDecision]: ...

    def details(self) -> dict[str, str]: ...


class AcrossWorkersPart(Protocol):
    """The part that sums gradients across worker processes (see `strategies/multi_worker/across.py`)."""

    world_size: int
    sums_whole_backward: bool
    """True when gradients cross workers in buckets as backward produces them (one local replica)."""

    def prepare(self, replicas: list[nn.Module], replica_params: list[list[nn.Parameter]]) -> None: ...

    def begin_step(self, state: RunState) -> None: ...

    def grad_ready(self, index: int, state: RunState) -> None: ...

    def finish_backward(self, state: RunState) -> None: ...

    def after_backward(self, state: RunState) -> None: ...

    def sum_after_local_combine(
        self, replica: int, replica_params: list[list[nn.Parameter]], state: RunState
    ) -> None: ...

    def loss_weight_declared(self, count: float) -> None: ...

    def loss_weight_total(self, state: RunState, num_replicas_in_sync: int) -> float | None: ...

    def batch_norm_sum(self, tensor: torch.Tensor, what: str, step: int) -> Any: ...

    def decisions(self) -> list[PlacementDecision]: ...

    def details(self) -> dict[str, str]: ...


class ReplicaSet:
    """The replicas of one process, their threads and barrier, and the parts that combine them.

    Args:
        owner: the strategy whose replica contexts these are (what `ReplicaContext.strategy` names).
        placement, build, combine, across: the parts (see the module docstring).
        batch_norm: "global" or "per_replica" (checked by the strategy).
        timeout: seconds a replica waits for the others.
    """

    def __init__(
        self,
        owner: Any,
        placement: ReplicaDevices,
        *,
        build: ReplicaBuilder,
        combine: LocalCombine,
        across: AcrossWorkersPart | None = None,
        batch_norm: str,
        timeout: float,
    ) -> None:
        self.owner = owner
        self.placement = placement
        self.devices = placement.devices
        self.names = placement.names
        self.build = build
        self.combine = combine
        self.across = across
        self._batch_norm_mode = batch_norm
        self._timeout = timeout
        self.barrier = ReplicaBarrier(self.names, timeout)
        self._pool: ReplicaPool | None = None
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None  # what distribute returned (schedulers are handed it)
        self.replica_params: list[list[nn.Parameter]] = []
        self._queued = [False] * len(self.devices)
        self.combination = LocalCombination(self.barrier, len(self.devices))
        self.run_state: RunState | None = None
        self.step = 0
        self._empty_slices = EmptySlices()
        self._batch_norm: BatchNormSync | None = None
        self._accumulation = LocalAccumulation()
        build.attach(self)

    @property
    def parts(self) -> tuple[Any, ...]:
        """Every part, in the order a step meets them; each reports its own decisions to `explain()`."""
        parts = (self.placement, self.build, self.combine, self, self.across)
        return tuple(part for part in parts if part is not None)

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self.devices) * (self.across.world_size if self.across is not None else 1)

    @property
    def needs_gradient_sync(self) -> bool:
        """Whether replicas must combine gradients at the end of backward (several replicas, or workers)."""
        return len(self.devices) > 1 or self.across is not None

    def decisions(self) -> list[PlacementDecision]:
        """The set's own decision: which statistics BatchNorm layers use, with more than one replica in sync."""
        return [batch_norm_decision(self._batch_norm_mode)] if self.num_replicas_in_sync > 1 else []

    def details(self) -> dict[str, str]:
        details = {}
        if self.across is not None or len(self.devices) > 1:
            where = " across all workers" if self.across is not None else ""
            details["gradient weighting"] = (
                f"each replica's gradient weighted by its share of the global batch{where}, "
                "or by the loss weight its step declares (sg.set_loss_weight)"
            )
        if self.num_replicas_in_sync > 1:
            details["empty slices"] = EMPTY_SLICE_RULE
            if self._batch_norm is not None:
                details.update(self._batch_norm.describe())
        return details

    def current_replica(self) -> int | None:
        ctx = current_replica_context()
        if ctx is None or ctx.strategy is not self.owner:
            return None
        return ctx.replica_id_in_sync_group

    def meet(self, replica: int, what: str) -> None:
        """Inside a step, this process's replicas wait for each other at `what` (an optimizer or scheduler step)."""
        state = self.run_state
        if state is not None:
            self.barrier.wait(replica, what, state.step)

    # ---- distribute ---------------------------------------------------------------------------
    def distribute(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
        check_optimizer_supported(optimizer, self.num_replicas_in_sync, type(self.owner).__name__)
        self._batch_norm = BatchNormSync(
            self._batch_norm_mode,
            strategy=self.owner,
            barrier=self.barrier,
            num_local=len(self.devices),
            num_replicas_in_sync=self.num_replicas_in_sync,
            weight=self._replica_weight,
            step=lambda: self.step,
            cross_worker_sum=self.across.batch_norm_sum if self.across is not None else None,
        )
        # The replicas are made from a converted copy (BatchNorm layers of the global batch; parameters and
        # buffers shared with the user's model): the user's own modules are left as they are.
        built = self.build.build(self._batch_norm.convert(model), optimizer)
        replicas = built.replicas
        self.replica_params = [[p for p in r.parameters() if p.requires_grad] for r in replicas]
        if self.build.accumulates:
            self._accumulation.attach(self.replica_params, built.plain_optimizers)
        if self.across is not None:
            self.across.prepare(replicas, self.replica_params)
        self._batch_norm.attach(replicas)
        if self.build.steal:
            # A share of a small gradient costs more in Python calls than it saves; those are combined after
            # the meeting, all in one call (a model of 300 small layers ran 30-50% slower stealing them all).
            steal = isinstance(self.combine.reducer, InMemoryReduce) and len(replicas) > 1
            self.combination.attach(self.replica_params, steal, STEAL_MIN_ELEMENTS)
        if self.needs_gradient_sync:
            for r, params in enumerate(self.replica_params):
                for i, p in enumerate(params):
                    p.register_post_accumulate_grad_hook(self._make_grad_hook(r, i))
        if len(replicas) > 1:
            self._pool = ReplicaPool(self.names, self._setup_replica_thread, self._timeout)
        self.model = built.model
        self.optimizer = built.optimizer
        return built.model if optimizer is None else (built.model, built.optimizer)

    # ---- run ----------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """Runs `fn` once per replica, in parallel, each with its slice of the distributed inputs."""
        if not callable(fn):
            raise InputError(f"run() needs a function to call once per replica. Received: {type(fn).__name__}.")
        kwargs = dict(kwargs or {})
        args = tuple(args)
        num_replicas = len(self.devices)
        batch_sizes = run_inputs.batch_sizes(args, kwargs, num_replicas)
        global_size = run_inputs.global_size(args, kwargs)
        self.step += 1
        weights = run_inputs.replica_weights(batch_sizes, global_size, num_replicas, self.num_replicas_in_sync)
        self.run_state = state = RunState(self.step, weights)
        self._empty_slices.begin_step(batch_sizes)
        if self._batch_norm is not None:
            self._batch_norm.begin_step()
        self._queued = [False] * num_replicas
        self.combination.begin_run()
        self._accumulation.begin_run(state.weights, self.step)
        self.build.begin_step()
        if self.across is not None:
            self.across.begin_step(state)
        try:
            if num_replicas == 1:
                results = [self._run_one(fn, args, kwargs)]
            else:
                results = self._run_all(fn, args, kwargs)
        finally:
            self.run_state = None
            self._accumulation.end_run()
        self.build.end_run()
        if num_replicas == 1 and self.num_replicas_in_sync == 1:
            return results[0]
        return loss_weight.tag_results(stack_replicas(results, batch_sizes, global_size), state.counts)

    def _run_all(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[Any]:
        num_replicas = len(self.devices)
        if self._pool is None:
            self._pool = ReplicaPool(self.names, self._setup_replica_thread, self._timeout)
        self.barrier.reset()
        self.combination.reset(self.replica_params)
        self.combination.stealing = self.combination.steal and capture_placement() is None
        grad_enabled = torch.is_grad_enabled()
        warn_if_profiling_one_thread(self.owner, num_replicas)

        def job(replica: int) -> Any:
            ctx = ReplicaContext(replica, self.num_replicas_in_sync, self.devices[replica], self.owner)
            previous = enter_replica(ctx)
            try:
                with torch.set_grad_enabled(grad_enabled), run_inputs.device_guard(self.devices[replica]):
                    return fn(*select_replica(args, replica), **select_replica(kwargs, replica))
            except BaseException as error:
                self.barrier.abort(error)  # before finish(): waiting replicas must see the cause, not an early exit
                raise
            finally:
                enter_replica(previous)
                self.barrier.finish(replica)

        threads = self.placement.threads
        caller_threads = torch.get_num_threads()
        if threads is not None and self.devices[0].type == "cpu":
            torch.set_num_threads(threads)
        try:
            return self._pool.run(job, on_error=self.barrier.abort)
        finally:
            if torch.get_num_threads() != caller_threads:
                torch.set_num_threads(caller_threads)

    def _run_one(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        previous = enter_replica(ReplicaContext(0, self.num_replicas_in_sync, self.devices[0], self.owner))
        try:
            with run_inputs.device_guard(self.devices[0]):
                return fn(*select_replica(args, 0), **select_replica(kwargs, 0))
        except NotImplementedError as error:
            translated = as_placement_error(error)  # torch's "Could not run ... backend", with the fix
            if translated is None:
                raise
            raise translated from error
        finally:
            enter_replica(previous)

    def _setup_replica_thread(self, replica: int) -> None:
        device = self.devices[replica]
        if device.type == "cpu" and self.placement.threads is not None:
            torch.set_num_threads(self.placement.threads)
        elif device.type == "cuda":
            torch.cuda.set_device(device)

    # ---- gradient combination at the end of backward -------------------------------------------
    def _make_grad_hook(self, replica: int, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if self._accumulation.active and self._accumulation.skips(replica):
                return  # inside no_sync(): this replica's gradient only accumulates (strategies/data_parallel/accumulation.py)
            self.combination.grad_ready(replica, index)  # a replica waiting may combine this one now
            state = self.run_state
            if self.across is not None and state is not None:
                self.across.grad_ready(index, state)
            if not self._queued[replica]:
                self._queued[replica] = True
                # Runs once when this backward pass has finished, before backward() returns.
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self._on_backward_end(replica))

        return hook

    def _on_backward_end(self, replica: int) -> None:
        self._queued[replica] = False
        state = self.run_state
        # Not the thread-local replica context: on a GPU this callback runs on torch's autograd thread
        # for that device, not on the replica's own thread.
        if state is None:
            raise InputError(
                "backward() ran on a distributed model outside strategy.run(), so the replicas cannot combine "
                "their gradients and would drift apart. Call loss.backward() inside the function given to "
                "strategy.run()."
            )
        across = self.across
        if across is not None and across.sums_whole_backward:
            # One local replica: its buckets went across as backward filled them.
            across.finish_backward(state)
            self._divide_by_loss_weights(replica, state)
            across.after_backward(state)  # after the division: the gradients are views of the buckets
            return
        self.combination.combine(replica, self.replica_params, self.combine.reducer, state.weights, state.step)
        if across is not None:
            # Not only when this worker has gradients: the others may, and every worker must join the sum.
            across.sum_after_local_combine(replica, self.replica_params, state)
            self.barrier.wait(replica, "gradient combination across workers", state.step)
        self._divide_by_loss_weights(replica, state)

    def _divide_by_loss_weights(self, replica: int, state: RunState) -> None:
        total = self._loss_weight_total(state)
        if total is not None:
            loss_weight.divide_gradients_(self.replica_params[replica], total)

    # ---- losses weighted by declared counts (strategies/data_parallel/loss_weight.py) ---------------------------
    def declare_loss_weight(self, replica: int, count: float) -> None:
        state = self.run_state
        if state is not None:
            loss_weight.declare(state, replica, count, len(self.devices))
            if self.across is not None:
                self.across.loss_weight_declared(count)

    def _loss_weight_total(self, state: RunState) -> float | None:
        """The count the combined gradients are divided by (None: weighted by examples, nothing to divide)."""
        if self.across is not None:
            return self.across.loss_weight_total(state, self.num_replicas_in_sync)
        total, declared = loss_weight.local_total(state.counts)
        return loss_weight.check_total(total, declared, len(self.devices), state.step)

    def _replica_weight(self, replica: int) -> float | None:
        state = self.run_state
        return None if state is None else state.weights[replica]

    # ---- what the model and the user call -----------------------------------------------------
    def call_replica(self, model: nn.Module, args: tuple, kwargs: dict) -> Any:
        """The distributed model's call on the running replica (a stand-in on an empty slice)."""
        return self._empty_slices.call(model, self.current_replica(), args, kwargs)

    def no_sync(self) -> Any:
        """Accumulation without combining (see `MirroredStrategy.no_sync`); nothing to skip where every backward
        combines anyway (one replica, or central storage)."""
        if not (self.build.accumulates and self.needs_gradient_sync):
            return contextlib.nullcontext()
        return self._accumulation.no_sync(inside_run=self.current_replica() is not None)

    def close(self) -> None:
        """Stops the replica threads; converted BatchNorm layers run as their plain class from then on."""
        if self._batch_norm is not None:
            self._batch_norm.remove()
        self._accumulation.close()
        if self._pool is not None:
            self._pool.close()
            self._pool = None
