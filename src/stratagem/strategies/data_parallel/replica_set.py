"""The data-parallel core: one process's replicas, run in lockstep, and the ordered parts around each step.

Mirrored, OneDevice, CentralStorage and MultiWorkerMirrored each hold one `ReplicaSet` and differ
only in the parts they give it:

- `placement` (`placement.ReplicaDevices`): the devices and their threads;
- `build` (a `step_part.ReplicaBuilder`): how `distribute` makes the replicas and the optimizer
  (`mirrored_replicas.MirroredReplicas`: a copy per device; `central_storage.update.CentralUpdate`: one
  central copy, updated once per step);
- `combine` (`combine.LocalCombine`, or None): the reducer of the local combination at the end of backward;
- `across` (`strategies/multi_worker/across.py`, or None in one process): the sum across worker processes.

The set owns the replica threads and their barrier, `run`'s inputs and weights and the hook at the end of
each backward pass; everything else is a `StepPart` in one ordered tuple (`_step_parts`), which the set
iterates at `distribute`, around each step, at each gradient, at the end of backward, and at `close`.
The set is the replicas' `host.ReplicaHost`: what runs inside the replicas calls it through that protocol.
`explain()` collects the decisions of the placement and of every part; no part edits another's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stratagem import nest
from stratagem.diagnose.soft_placement import as_placement_error
from stratagem.errors import InputError
from stratagem.strategies import run_inputs
from stratagem.strategies.data_parallel.accumulation import LocalAccumulation
from stratagem.strategies.data_parallel.combine import LocalCombination, LocalCombine
from stratagem.strategies.data_parallel.cpu_threads.replica_random import ReplicaRandomPart
from stratagem.strategies.data_parallel.distributed import check_optimizer_supported
from stratagem.strategies.data_parallel.empty_slices import EmptySlices
from stratagem.strategies.data_parallel.host import ReplicaHost
from stratagem.strategies.data_parallel.outside_changes import OutsideChanges
from stratagem.strategies.data_parallel.placement import ReplicaDevices
from stratagem.strategies.data_parallel.profiling import warn_if_profiling_one_thread
from stratagem.strategies.data_parallel.replicas import ReplicaBarrier, ReplicaPool
from stratagem.strategies.data_parallel.set_parts import (
    AcrossWorkers,
    BatchNormPart,
    BucketRestart,
    BucketSum,
    LocalCombinationPart,
    LossWeights,
    ReportedOnly,
    WorkerSumAfterCombination,
)
from stratagem.strategies.data_parallel.step_part import ReplicaBuilder, RunState, StepPart
from stratagem.strategies.replica_context import ReplicaContext, current_replica_context, enter_replica
from stratagem.trace import Recorder
from stratagem.values import select_replica, stack_replicas, tag_results

if TYPE_CHECKING:
    from stratagem.strategies.base import Strategy

logger = logging.getLogger(__name__)

STEAL_MIN_ELEMENTS = 64 * 1024
"""A replica waiting at the end of backward combines early only shares of at least this many elements."""


def _overrides(part: StepPart, member: str) -> bool:
    return getattr(type(part), member) is not getattr(StepPart, member)


class ReplicaSet(ReplicaHost):
    """The replicas of one process, their threads and barrier, and the parts around each step.

    Args:
        strategy: the strategy whose replica contexts these are (what `ReplicaContext.strategy` names).
        placement, build, combine, across: the parts (see the module docstring); `combine=None` for a
            strategy whose replicas do not combine their gradients here (their library does).
        batch_norm: "global" or "per_replica" (checked by the strategy).
        timeout: seconds a replica waits for the others.
        recorder: where each step, forward, backward and optimizer step is recorded while it is on
            (`stratagem.trace`); None: nowhere.
    """

    def __init__(
        self,
        strategy: Strategy,
        placement: ReplicaDevices,
        *,
        build: ReplicaBuilder,
        combine: LocalCombine | None,
        across: AcrossWorkers | None = None,
        batch_norm: str,
        timeout: float,
        recorder: Recorder | None = None,
    ) -> None:
        self._strategy = strategy
        self._recorder = recorder
        self._backward_start: list[int | None] = [None] * len(placement.devices)
        self._trace_hooks: list[Any] = []  # the step hooks on a user's own optimizer handed back (one replica)
        self.placement = placement
        self.devices = placement.devices
        self.names = placement.names
        self.build = build
        self.across = across
        self._timeout = timeout
        self.barrier = ReplicaBarrier(self.names, timeout)
        self._pool: ReplicaPool | None = None
        self.model: nn.Module | None = None  # what the first distribute returned (fit trains it)
        self.optimizer: torch.optim.Optimizer | None = None  # what the first distribute returned with an optimizer
        self.optimizers: list[Any] = []  # what every distribute returned as the optimizer (schedulers pick theirs)
        self._distributed_ids: set[int] = set()  # every parameter of the models distributed so far
        self._replica_params: list[list[nn.Parameter]] = []
        self._queued = [False] * len(self.devices)
        self.run_state: RunState | None = None
        self.step = 0
        self._warned_profiler = False
        self._warned_whole: set[str] = set()  # the arguments run_inputs.warn_whole_tensors warned about
        self._outside = OutsideChanges()
        self._empty_slices = EmptySlices(self.num_replicas_in_sync)
        self._accumulation = LocalAccumulation()
        self._random = ReplicaRandomPart(self.devices, lambda: build.first_global_replica)
        self._loss_weights = LossWeights(len(self.devices), self.num_replicas_in_sync, across)
        self._combination = (
            LocalCombinationPart(
                combine,
                self.barrier,
                len(self.devices),
                may_steal=build.steal,
                steal_min=lambda: STEAL_MIN_ELEMENTS,  # read at distribute: a test lowers it
                # Gradients accumulated under no_sync() are each replica's own: the next pass combines them all.
                accumulated=lambda: build.accumulates and self._accumulation.pending,
            )
            if combine is not None
            else None
        )
        self._batch_norm = BatchNormPart(
            batch_norm,
            strategy=strategy,
            barrier=self.barrier,
            num_local=len(self.devices),
            num_replicas_in_sync=self.num_replicas_in_sync,
            weight=self._replica_weight,
            step=lambda: self.step,
            across=across,
        )
        self.step_parts = self._step_parts()
        self._grad_parts = tuple(p for p in self.step_parts if _overrides(p, "grad_ready"))
        self._backward_parts = tuple(p for p in self.step_parts if _overrides(p, "end_of_backward"))
        build.attach(self, placement)

    def _step_parts(self) -> tuple[StepPart, ...]:
        """Every part, in the order a step meets them: a new part is one more entry here.

        At the end of backward the order is the arithmetic's: the local combination, then the sum across
        workers, then the division by the declared loss weights, which needs the sums complete.
        """
        several = len(self.devices) > 1
        parts: list[StepPart] = [self.build, self._random, self._empty_slices, self._batch_norm]
        if self.build.accumulates:
            parts.append(self._accumulation)
        combination = self._combination
        if combination is not None:
            # One replica has nothing to combine; its reducer is still reported.
            parts.append(combination if several else ReportedOnly(combination))
        across = self.across
        if across is not None and several:
            parts += [WorkerSumAfterCombination(across, self.barrier), self._loss_weights]
        elif across is not None:
            # One local replica: its gradients cross in buckets as backward produces them; the buckets are
            # restarted after the division, since the gradients are views of them.
            parts += [BucketSum(across), self._loss_weights, BucketRestart(across)]
        elif combination is not None and several:
            parts.append(self._loss_weights)
        return tuple(parts)

    @property
    def parts(self) -> tuple[Any, ...]:
        """Every part that reports to `explain()`, in the order a step meets them."""
        return (self.placement, *self.step_parts)

    # ---- the host protocol (host.py) -----------------------------------------------------------
    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def num_local_replicas(self) -> int:
        return len(self.devices)

    @property
    def replica_params(self) -> list[list[nn.Parameter]]:
        return self._replica_params

    @property
    def combination(self) -> LocalCombination | None:
        """The state of the local replicas' meeting at the end of backward (None without a combining part)."""
        return self._combination.combination if self._combination is not None else None

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self.devices) * (self.across.world_size if self.across is not None else 1)

    def current_replica(self) -> int | None:
        ctx = current_replica_context()
        if ctx is None or ctx.host is not self:
            return None
        return ctx.replica_id_in_sync_group

    def meet(self, replica: int, what: str) -> None:
        state = self.run_state
        if state is not None:
            self.barrier.wait(replica, what, state.step)

    @property
    def recorder(self) -> Recorder | None:
        return self._recorder

    def call_replica(self, model: nn.Module, args: tuple, kwargs: dict) -> Any:
        recorder = self._recorder
        if recorder is None or not recorder.on:
            return self._empty_slices.call(model, self.current_replica(), args, kwargs)
        replica = self.current_replica()
        start = recorder.now()
        out = self._empty_slices.call(model, replica, args, kwargs)
        recorder.span("forward", "forward", start, recorder.now())
        if replica is not None and torch.is_grad_enabled():
            self._mark_backward_start(out, replica, recorder)
        return out

    def _mark_backward_start(self, out: Any, replica: int, recorder: Recorder) -> None:
        """Backward starts, for the trace, when the gradient of the model's first output that needs one is made
        (the loss's own backward before it is short); it ends in `_on_backward_end`."""
        first = next((t for t in nest.flatten(out) if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if first is None:
            return

        def started(_: torch.Tensor) -> None:
            if self._backward_start[replica] is None:
                self._backward_start[replica] = recorder.now()

        first.register_hook(started)

    def declare_loss_weight(self, replica: int, count: float) -> None:
        state = self.run_state
        if state is not None:
            self._loss_weights.declare(state, replica, count)
            self._batch_norm.sync.weight_declared(replica)

    # ---- distribute ---------------------------------------------------------------------------
    def distribute(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
        """Replicas of `model` (and `optimizer`); called again for every further model of the same steps (a GAN's
        generator and discriminator, a teacher, an EMA copy). Every model's trainable parameters are appended to
        each replica's list; at the end of each backward pass the parts combine the gradients that pass reached,
        whichever models they belong to."""
        check_optimizer_supported(optimizer, self.num_replicas_in_sync, type(self._strategy).__name__)
        self._check_another_model(model)
        # The replicas are made from a converted copy (BatchNorm layers of the global batch; parameters and
        # buffers shared with the user's model): the user's own modules are left as they are.
        built = self.build.build(self._batch_norm.convert(model), optimizer)
        replicas = built.replicas
        first = len(self._replica_params[0]) if self._replica_params else 0
        added = [[p for p in r.parameters() if p.requires_grad] for r in replicas]
        if not self._replica_params:
            self._replica_params = [[] for _ in replicas]
        for mine, new in zip(self._replica_params, added):
            mine.extend(new)  # in place: the parts hold this list of lists
        self._distributed_ids.update(id(p) for r in (model, *replicas) for p in r.parameters())
        for part in self.step_parts:
            part.prepare(built, self._replica_params)
        self._outside.watch(built.primary if built.primary is not None else replicas[0], replicas)
        if self._backward_parts or self._grad_parts:
            for r, params in enumerate(added):
                for i, p in enumerate(params, start=first):
                    p.register_post_accumulate_grad_hook(self._make_grad_hook(r, i))
        if len(replicas) > 1 and self._pool is None:
            self._pool = ReplicaPool(self.names, self._setup_replica_thread, self._timeout)
        if self._recorder is not None and optimizer is not None and built.optimizer is optimizer:
            self._trace_optimizer(optimizer, self._recorder)
        if self.model is None:
            self.model = built.model
        if self.optimizer is None:
            self.optimizer = built.optimizer
        self.optimizers.append(built.optimizer)
        return built.model if optimizer is None else (built.model, built.optimizer)

    def _trace_optimizer(self, optimizer: torch.optim.Optimizer, recorder: Recorder) -> None:
        """The user's own optimizer, handed back as it is (one private replica): its steps are traced through
        torch's step hooks (the optimizers `distribute` makes trace their own)."""
        started: list[int | None] = [None]

        def pre(*_: Any) -> None:
            started[0] = recorder.now() if recorder.on else None

        def post(*_: Any) -> None:
            if started[0] is not None and recorder.on:
                recorder.span("optimizer", "optimizer step", started[0], recorder.now())

        self._trace_hooks += [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]

    def _check_another_model(self, model: nn.Module) -> None:
        """Refuses a second `distribute` inside a step, or of a model that shares parameters with one already
        distributed (its gradients would be combined twice)."""
        if self.current_replica() is not None:
            raise InputError(
                "strategy.distribute() was called inside strategy.run(), where every replica would make its own "
                "copies. Received: distribute() on a replica's thread. Distribute every model before the first run."
            )
        shared = [name for name, p in model.named_parameters() if id(p) in self._distributed_ids]
        if shared:
            raise InputError(
                "The model shares parameters with a model this strategy already distributed, so their gradients "
                f"would be combined twice. Received: {len(shared)} shared parameter(s), first '{shared[0]}'. "
                "Distribute the model that holds both once (an nn.Module with both as sub-modules), or give the "
                "second model parameters of its own (copy.deepcopy)."
            )

    # ---- run ----------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """Runs `fn` once per replica, in parallel, each with its slice of the distributed inputs."""
        if not callable(fn):
            raise InputError(f"run() needs a function to call once per replica. Received: {type(fn).__name__}.")
        kwargs = dict(kwargs or {})
        args = tuple(args)
        num_replicas = len(self.devices)
        run_inputs.warn_whole_tensors(args, kwargs, num_replicas, self._warned_whole)
        batch_sizes = run_inputs.batch_sizes(args, kwargs, num_replicas)
        global_size = run_inputs.global_size(args, kwargs)
        # Before the parts start the step (central storage refreshes its copies' buffers in that order).
        self._outside.replay()
        self.step += 1
        weights = run_inputs.replica_weights(batch_sizes, global_size, num_replicas, self.num_replicas_in_sync)
        self.run_state = state = RunState(self.step, weights, batch_sizes)
        recorder = self._recorder if self._recorder is not None and self._recorder.on else None
        if recorder is not None:
            recorder.at_step(self.step)
            started = recorder.now()
        self._queued = [False] * num_replicas
        for part in self.step_parts:
            part.begin_step(state)
        try:
            if num_replicas == 1:
                results = [self._run_one(fn, args, kwargs)]
            else:
                results = self._run_all(fn, args, kwargs)
        finally:
            self.run_state = None
            for part in self.step_parts:
                part.end_run(state)
            self._outside.after_run()  # what the step did is every replica's own; what comes next is a script's
            if recorder is not None:
                recorder.span("step", f"step {state.step}", started, recorder.now())
            if self._recorder is not None and self._recorder.recording:
                self._recorder.after_step(state.step)  # a sampled trace decides whether the next step records
        if num_replicas == 1 and self.num_replicas_in_sync == 1:
            return results[0]
        return tag_results(stack_replicas(results, batch_sizes, global_size), state.counts)

    def _run_all(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[Any]:
        num_replicas = len(self.devices)
        if self._pool is None:
            self._pool = ReplicaPool(self.names, self._setup_replica_thread, self._timeout)
        self.barrier.reset()
        grad_enabled = torch.is_grad_enabled()
        self._warned_profiler = warn_if_profiling_one_thread(num_replicas, warned=self._warned_profiler)

        def job(replica: int) -> Any:
            ctx = ReplicaContext(replica, self.num_replicas_in_sync, self.devices[replica], self._strategy, self)
            previous = enter_replica(ctx)
            try:
                with (
                    torch.set_grad_enabled(grad_enabled),
                    run_inputs.device_guard(self.devices[replica]),
                    self._random.random(replica),
                    self.build.around_replica(replica),  # above the random stream: sees each operator first
                ):
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
        ctx = ReplicaContext(0, self.num_replicas_in_sync, self.devices[0], self._strategy, self)
        previous = enter_replica(ctx)
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

    # ---- the end of backward: the parts that act on gradients ---------------------------------
    def _make_grad_hook(self, replica: int, index: int) -> Callable[[torch.Tensor], None]:
        accumulation = self._accumulation if self.build.accumulates else None
        grad_parts = self._grad_parts

        def hook(_: torch.Tensor) -> None:
            if accumulation is not None and accumulation.active and accumulation.skips(replica):
                return  # inside no_sync(): this replica's gradient only accumulates (accumulation.py)
            state = self.run_state
            if state is not None:
                for part in grad_parts:
                    part.grad_ready(replica, index, state)
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
        for part in self._backward_parts:
            part.end_of_backward(replica, state)
        recorder = self._recorder
        start = self._backward_start[replica]
        if recorder is not None and start is not None:
            self._backward_start[replica] = None
            if recorder.on:
                recorder.span("backward", "backward", start, recorder.now())

    def _replica_weight(self, replica: int) -> float | None:
        state = self.run_state
        return None if state is None else state.weights[replica]

    # ---- what the user calls ------------------------------------------------------------------
    def no_sync(self) -> Any:
        """Accumulation without combining (see `MirroredStrategy.no_sync`); nothing to skip where every backward
        combines anyway (one replica, or central storage)."""
        if not (self.build.accumulates and self._backward_parts):
            return contextlib.nullcontext()
        return self._accumulation.no_sync(inside_run=self.current_replica() is not None)

    def close(self) -> None:
        """Stops the replica threads; every part removes what it installed (converted BatchNorm layers run as
        their plain class from then on)."""
        for part in self.step_parts:
            part.close()
        for handle in self._trace_hooks:
            handle.remove()
        self._trace_hooks = []
        if self._pool is not None:
            self._pool.close()
            self._pool = None
