"""ShardedStrategy: data parallelism whose parameters, gradients and optimizer state are sharded (ZeRO).

One process per worker, as under MultiWorkerMirroredStrategy (`stratagem launch --workers N`, torchrun,
SLURM, TF_CONFIG), the same training script. Built on torch's own FSDP2 (`fully_shard`), DTensor and
DeviceMesh: each rank keeps 1/N of every parameter, gradient and optimizer state tensor; a unit's
parameters are all-gathered for its forward and backward and its gradients reduce-scattered, weighted
so that the result is one device's update on the global batch whatever the split (weighting.py).

stage=3 (DeepSpeed ZeRO-3) frees each unit's gathered parameters after its forward and gathers them
again for backward; stage=2 (`reshard_after_forward=False`) keeps them from forward to backward: one
all-gather per step instead of two, for a peak of the whole model's parameters (docs/sharded.md).
"""

from __future__ import annotations

import contextlib
import json
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from stratagem import environ
from stratagem.cluster import Cluster, allocator
from stratagem.cluster.worker_group import plan_worker_group
from stratagem.diagnose import PlacementDecision
from stratagem.errors import InputError
from stratagem.shm import eligibility
from stratagem.strategies.data_parallel.batch_norm import BatchNormSync, batch_norm_decision
from stratagem.strategies.data_parallel.distributed import clone_optimizer
from stratagem.strategies.data_parallel.host import LossWeightHost
from stratagem.strategies.data_parallel.replicas import ReplicaBarrier
from stratagem.strategies.explain import Explanation, ReplicaPlacement
from stratagem.strategies.replica_context import ReplicaContext, enter_replica
from stratagem.strategies.run_inputs import batch_sizes, global_size, replica_weights
from stratagem.strategies.sharded.checkpoint import ShardedStateShards
from stratagem.strategies.sharded.checks import (
    check_another_model,
    check_device,
    check_optimizer,
    check_shards,
    check_stage,
    copy_refusal,
    shard_records,
)
from stratagem.strategies.sharded.decisions import sharded_decisions
from stratagem.strategies.sharded.host_memory import HostMemory, check_host_memory
from stratagem.strategies.sharded.memory import MemoryPlan, release_freed_memory
from stratagem.strategies.sharded.optimizer import prefer_foreach
from stratagem.strategies.sharded.placement import local_device
from stratagem.strategies.sharded.rank_memory import RankMemory
from stratagem.strategies.sharded.scope import BuiltModel, sharded_scope
from stratagem.strategies.sharded.techniques import TECHNIQUES, Sharding, shard_cut, techniques_line
from stratagem.strategies.sharded.tracing import ShardedTrace
from stratagem.strategies.sharded.transport import connect_transport
from stratagem.strategies.sharded.units import UnitCut, UnitPolicy, cut_model
from stratagem.strategies.worker_group.input import InputSharding
from stratagem.strategies.worker_group.step_agreement import StepAgreement, check_batches_flag
from stratagem.strategies.worker_group.strategy import WorkerGroupStrategy
from stratagem.strategies.worker_group.techniques import ONE_DATA_AXIS, apply_techniques
from stratagem.strategies.wrapped_model import WrappedModel
from stratagem.trace import Recorder, Traceable
from stratagem.trace.recorder import Clock

if TYPE_CHECKING:
    from stratagem.strategies.sharded.reduce_scatter import WeightedReduceScatter
from stratagem.values import select_replica, stack_replicas, tag_results


class ShardedStrategy(WorkerGroupStrategy, LossWeightHost, Traceable):
    """Sharded data parallelism on FSDP2, exact on any split of the global batch.

    Args:
        stage: 3 (default): parameters, gradients and optimizer state sharded, each unit gathered for its
            forward and again for its backward (ZeRO-3). 2: gathered parameters kept from forward to backward.
        units: how the model is cut into units gathered one at a time: None (each child of a ModuleList or
            Sequential; at stage 2 consecutive ones merged into units of up to 8 MiB, and a model of at most 8 MiB
            one unit: units.py), a tuple of module classes, or a callable of a module.
        device: this worker's device (default: the GPU of its local rank, else the CPU: placement.py).
        cluster: a `Cluster`, a TF_CONFIG-shaped dict, or None to resolve from the environment.
        timeout: seconds any wait (rendezvous, collective) may last before an error naming who is missing.
        param_dtype, reduce_dtype: FSDP2's `MixedPrecisionPolicy` (e.g. torch.bfloat16 for both).
        shared_memory: all-gather and reduce-scatter through shared memory when every worker runs on this host
            (None, the default: whenever they can; False: always through the process group; True: an error unless
            they can); `explain()` says which, and why (transport.py).
        check_batches: True (default): at each step the workers compare a fingerprint of the step and of the global
            batch they were handed, and all stop with an `InputError` naming the step, the workers and the first
            input that differs (agreement.py). False: nothing compared (pass it on every worker alike).
        host_memory: "release" (default): host memory a step frees goes back to the system at once, so the resident
            set follows the memory plan. "reuse": kept for the next step once the optimizer's state exists, which
            saves each step's page faults but lets the peak exceed the plan (host_memory.py).

    Example:
        >>> strategy = sg.ShardedStrategy(stage=3)               # under `stratagem launch --workers 2`
        >>> model, optimizer = strategy.distribute(Net(), torch.optim.AdamW(...))
        >>> print(strategy.memory_plan())                        # bytes per rank, before the first step
        >>> for x, y in strategy.distribute_dataset(loader):     # every worker iterates the same global batches
        ...     strategy.run(train_step, args=(x, y))
    """

    samples_steps: ClassVar[bool] = True  # its trace ends every step with Recorder.after_step (fit samples them)

    # Parts, in the order they are applied (torchtitan's parallelize_llama order: cut, shard, then the rest):
    #   group      cluster.worker_group: the plan checked, then the process group and its DeviceMesh
    #   transport  transport.connect_transport: one host's shared memory for the units' collectives, else the group
    #   checks     checks.py: stage, device against the backend, optimizer that can run on shards
    #   batch norm data_parallel.batch_norm: BatchNorm layers converted to global statistics, summed across workers
    #   units      units.cut_model: each block a unit by default (stage 2: small ones merged), or the user's policy
    #   techniques techniques.TECHNIQUES, in order: data sharding along the group's one `data` axis, fully_shard
    #              per unit then the root (units.apply_cut; stage 2: reshard_after_forward=False), and SUM
    #              reduce-scatters of gradients pre-scaled by each rank's share (weighting.weigh_gradients)
    #   optimizer  distributed.clone_optimizer: the user's optimizer over the shards (foreach: optimizer.py)
    #   memory     memory.plan_memory: bytes per rank, said before the first step
    #   input      worker_group.input (WorkerGroupStrategy's): each worker's part of every global batch

    def __init__(
        self,
        stage: int = 3,
        *,
        units: UnitPolicy = None,
        device: str | torch.device | None = None,
        cluster: Cluster | Mapping[str, Any] | None = None,
        timeout: float = 300.0,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        shared_memory: bool | None = None,
        check_batches: bool = True,
        host_memory: str = "release",
    ) -> None:
        self._stage = check_stage(stage)
        check_batches = check_batches_flag(check_batches)
        self._policy = units
        env = environ.current()
        eligibility.check_wanted(shared_memory, env)  # STRATAGEM_SHARED_MEMORY=0 against shared_memory=True
        # Before the model is built: freed units, gradients and whole tensors then leave the resident set at once,
        # which the memory plan assumes (allocator.map_large_blocks_here, memory.py).
        self._host = HostMemory(check_host_memory(host_memory), allocator.map_large_blocks_here(env))
        plan = plan_worker_group(cluster, timeout=timeout, env=env)
        self._device_decision: PlacementDecision | None = None
        if device is None:
            device, self._device_decision = local_device(plan.cluster, env)
        self._device = torch.device(device)
        self._join_group(plan, [self._device], env=env)
        try:  # the collectives' path: this host's shared memory, else the process group (transport.py)
            self._transport = connect_transport(self._group, self._device, shared_memory)
        except BaseException:
            self._group.close(release=False)  # refused (shared_memory=True where it cannot be): nothing left open
            raise
        self._flight = self._group.cross_worker.flight  # the units' collectives kept beside the worker group's
        self._agreement = StepAgreement(self._group, enabled=check_batches)
        self._batch_agreement = self._agreement.batch
        self._state_shards = ShardedStateShards(self._group)
        self._trace = ShardedTrace(self._group, step=lambda: self._steps, env=env)  # off until a trace starts
        self._mp = (param_dtype, reduce_dtype)
        # Per model distributed, in order: its gradients' weighting, cut, memory plan, FSDP2 module.
        self._comms: list[WeightedReduceScatter] = []
        self._cuts: list[UnitCut] = []
        self._memory = RankMemory(
            self._group, stage=self._stage, device=self._device, policy=units, mp=self._mp, host=self._host
        )
        self._shardeds: list[Any] = []
        # The parameters of the user's models distributed so far, by id (weakly: a dropped model's ids get reused).
        self._held: dict[int, weakref.ref[torch.Tensor]] = {}
        self._built: dict[int, BuiltModel] = {}  # models made inside scope(), sharded there, by id, until distributed
        self._running = False
        self._counts: float | None = None
        self._accumulated: list[float] = []
        self._syncing = True
        self._input_sharding = InputSharding()
        self._steps = 0
        # BatchNorm over the global batch: the data-parallel strategies' layers, one replica per process, their
        # statistics summed through the worker group's bounded collectives as MultiWorkerMirroredStrategy does.
        self._batch_norm = BatchNormSync(
            "global",
            strategy=self,
            barrier=ReplicaBarrier([self._group.cluster.task_name], timeout),
            num_local=1,
            num_replicas_in_sync=self._group.world_size,
            weight=lambda replica: self._comms[0].weight if self._comms else None,
            step=lambda: self._steps,
            cross_worker_sum=self._batch_norm_sum,
        )
        self._finish_building()

    # ---- Strategy ---------------------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        return self._group.world_size

    @property
    def holds_whole_state(self) -> bool:
        """False: each process holds 1/N of the state, which a backup of the chief's would not hold."""
        return False

    def state_shards(self) -> ShardedStateShards:
        """Each rank saves and loads its own shards (`checkpoint.py`); `BackupAndRestore` reads this."""
        return self._state_shards  # one for the strategy's life: its asynchronous saves' process group is made once

    @property
    def stage(self) -> int:
        return self._stage

    def distribute(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """`model` sharded in place (as `fully_shard` does: its parameters become this rank's shards, its whole
        tensors are freed once nothing else holds them) and `optimizer` rebuilt over the shards.

        The model handed back calls, lists and saves the sharded module, which is its `.module` (as under DDP).
        The optimizer passed in still holds the whole parameters until it is dropped (`model, optimizer =
        strategy.distribute(net, optimizer)` drops it). A plan over this process's memory limit is refused here.

        Several models (a GAN's two) are distributed one call each, before the loop, each sharded on its own.

        Refused: an optimizer that needs whole tensors (LBFGS), one that already holds state, parameters on a
        device the process group cannot reach (CUDA tensors on Gloo), a model whose parameters were distributed
        before, and a call inside `run`. The whole model as one unit is allowed
        with a warning that its peak is the unsharded model.
        """
        built = self._built.pop(id(model), None)
        if built is not None and built.model() is model:  # made inside scope(): sharded there already (scope.py)
            return self._distribute_built(model, optimizer, built)
        self._check_distribute_args(model, optimizer, None)
        check_another_model(model, running=self._running, held=self._held)
        check_optimizer(optimizer)
        check_device(((name, p.device) for name, p in model.named_parameters()), self._group.backend)
        # Sharded in place, as fully_shard does: a copy would hold the whole model a second time, at the peak of
        # distribute and for as long as the user keeps the module (issue 39). BatchNorm layers are swapped in place.
        sharded = self._batch_norm.convert(model.to(self._device), in_place=True)
        cut = cut_model(sharded, self._policy, stage=self._stage)
        message = cut.warning()
        if message is not None:
            warnings.warn(message, stacklevel=2)
        originals = dict(model.named_parameters())
        # The plan is for the parameters as the user built them, before any is replaced by its shard.
        plan = self._memory.plan(list(model.parameters()), optimizer, cut)
        # Before anything is sharded: a plan over this process's memory limit is refused here, not by the kernel.
        cut_at = lambda stage: cut if stage == self._stage else cut_model(sharded, self._policy, stage=stage)  # noqa: E731
        self._memory.check_limit(plan, list(model.parameters()), optimizer, cut, cut_at)
        units, comm = self._apply_techniques(sharded, cut, sharded_already=False)
        if self._comms:
            comm.weight = self._comms[0].weight
        comm.rider = self._agreement  # the batch check rides the step's first reduce-scatter (agreement.py)
        self._check_shards(sharded)
        # Recorded only now: a refused model leaves the strategy as it was.
        self._batch_norm.attach([sharded])
        self._comms.append(comm)
        self._trace.add(sharded, list(zip(("root", *cut.names), units, strict=True)), comm)
        self._memory.cut = self._memory.cut if self._cuts else cut
        self._cuts.append(cut)
        self._memory.plans.append(plan)
        self._shardeds.append(sharded)
        self._held.update((id(p), weakref.ref(p)) for p in originals.values())
        # Behind a wrapper whose `.module` is the sharded module, as DDP's and FSDP1's (wrapped_model.py).
        wrapped = WrappedModel(
            sharded, "ShardedModel", copy_refused=copy_refusal(self._group.world_size), apply_in=self.scope
        )
        self._model = self._model if self._model is not None else wrapped
        if optimizer is None:
            del originals
            release_freed_memory()
            return wrapped
        mapping = {id(originals[name]): p for name, p in sharded.named_parameters()}
        clone = clone_optimizer(optimizer, mapping, with_state=False)
        prefer_foreach(clone)  # one DTensor operation per list of shards, not per shard (optimizer.py)
        self._host.watch(clone)
        del originals, mapping  # the whole tensors: freed now unless the user's optimizer still holds them
        release_freed_memory()
        self._trace.watch_optimizer(clone)
        return wrapped, clone

    def scope(self) -> contextlib.AbstractContextManager[None]:
        """TensorFlow's `strategy.scope()`: a model constructed inside is never whole in this process. It is built
        on meta, then cut, sharded in place and filled one parameter at a time, each value the one the same
        constructor gives on one device with the same seed (scope.py).

        Example:
            >>> with strategy.scope():
            ...     model = GPT2LMHeadModel(config)          # this rank's shards only, one device's values
            >>> model, optimizer = strategy.distribute(model, torch.optim.AdamW(model.parameters()))
        """
        return sharded_scope(self._shard_in_place, self._device, self._built)

    def _shard_in_place(self, model: nn.Module) -> UnitCut:
        cut = cut_model(model, self._policy, stage=self._stage)
        message = cut.warning()
        if message is not None:
            warnings.warn(message, stacklevel=4)
        # Data sharding's fully_shard, made here on meta; distribute runs the technique on with it done (techniques.py).
        shard_cut(model, cut, mesh=self._group.device_mesh(), stage=self._stage, mp=self._mp)
        return cut

    def _apply_techniques(
        self, model: nn.Module, cut: UnitCut, *, sharded_already: bool
    ) -> tuple[list[nn.Module], WeightedReduceScatter]:
        """`TECHNIQUES` applied to `model` in order (techniques.py): its units and their weighted reduce-scatter."""
        placing = Sharding(
            model=model,
            cut=cut,
            mesh=self._group.device_mesh(),
            stage=self._stage,
            mp=self._mp,
            shared=self._group.cross_worker.shared,
            step=lambda: self._steps,
            flight=self._flight,
            sharded_already=sharded_already,
        )
        apply_techniques(TECHNIQUES, placing, ONE_DATA_AXIS)
        assert placing.comm is not None, "the data sharding technique sets the units' reduce-scatter"
        return placing.units, placing.comm

    def _distribute_built(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, built: BuiltModel) -> Any:
        """`distribute` of a model built inside `scope()`: its units, weighting and checks, not its sharding."""
        check_optimizer(optimizer)
        if optimizer is not None:  # made inside the scope, it holds the parameters as construction made them
            optimizer = clone_optimizer(optimizer, {**built.mapping, **{id(p): p for p in model.parameters()}})
            prefer_foreach(optimizer)
            self._host.watch(optimizer)
        self._check_distribute_args(model, optimizer, None)
        plan = self._memory.plan(list(model.parameters()), optimizer, built.cut)
        units, comm = self._apply_techniques(model, built.cut, sharded_already=True)
        if self._comms:
            comm.weight = self._comms[0].weight
        comm.rider = self._agreement
        self._check_shards(model)
        self._batch_norm.attach([model])
        self._comms.append(comm)
        self._trace.add(model, list(zip(("root", *built.cut.names), units, strict=True)), comm)
        self._memory.cut = self._memory.cut if self._cuts else built.cut
        self._cuts.append(built.cut)
        self._memory.plans.append(plan)
        self._shardeds.append(model)
        self._held.update((id(p), weakref.ref(p)) for p in model.parameters())
        wrapped = WrappedModel(
            model, "ShardedModel", copy_refused=copy_refusal(self._group.world_size), apply_in=self.scope
        )
        self._model = self._model if self._model is not None else wrapped
        if optimizer is not None:
            self._trace.watch_optimizer(optimizer)
        return wrapped if optimizer is None else (wrapped, optimizer)

    def memory_plan(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        example_inputs: Any = None,
        activations: int | None = None,
    ) -> MemoryPlan:
        """Bytes this rank holds by category, and `total`, its peak over the resident set before the model.

        After `distribute`: the plan made then; before it, the plan for `model` and `optimizer` as they would be
        distributed. The step's activations count when given: `example_inputs` (one GLOBAL batch, measured on this
        rank's part: `activation_memory.py`) or `activations` (bytes), kept for `distribute`'s plans and limit.

        Example:
            >>> plan = strategy.memory_plan(net, optimizer, example_inputs={"input_ids": ids, "labels": ids})
        """
        return self._memory.memory_plan(model, optimizer, example_inputs, activations)

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """Runs `fn` on this worker's slice; its backward reduce-scatters gradients weighted by the slice's share."""
        kwargs = dict(kwargs or {})
        args = tuple(args)
        sizes = batch_sizes(args, kwargs, 1)
        weight = replica_weights(sizes, global_size(args, kwargs), 1, self.num_replicas_in_sync)[0]
        self._set_weight(weight)
        self._batch_norm.begin_step()  # the meetings count from zero; the native ones ask for this step's weight
        local_args, local_kwargs = select_replica((args, kwargs), 0)
        self._counts = None
        ctx = ReplicaContext(self._group.rank, self.num_replicas_in_sync, self._device, self, host=self)
        previous = enter_replica(ctx)
        self._running = True
        started = self._trace.step_started()
        self._agreement.start(self._steps + 1)  # compared when the step's first gradient sum lands, before updates
        try:
            result = fn(*local_args, **local_kwargs)
        except BaseException:
            self._agreement.drop()
            raise
        finally:
            self._running = False
            enter_replica(previous)
            self._steps += 1
        self._agreement.finish()  # a step without a reduce-scatter (evaluation, no_sync) is checked here
        self._host.after_step()  # host_memory="reuse": from the first step that made the optimizer's state
        self._trace.step_ended(started)
        stacked = stack_replicas([result], sizes, global_size(args, kwargs))
        return tag_results(stacked, None if self._counts is None else [self._counts])

    def trace(
        self, directory: str | Path, *, clock: Clock | None = None, mode: str = "spans"
    ) -> contextlib.AbstractContextManager[Recorder]:
        """Records the steps run inside the block on every worker: forward, backward, each unit's all-gather and
        reduce-scatter, each wait (tracing.py; docs/trace.md). Every worker enters the block at the same point.

        Example:
            >>> with strategy.trace("traces/"):
            ...     strategy.run(train_step, args=(x, y))
        """
        return self._trace.trace(directory, clock=clock, mode=mode)

    def _input_timing(self) -> tuple[None, Recorder]:
        return None, self._trace.recorder  # input spans while a trace records; stragglers are not judged here

    def _set_weight(self, weight: float) -> None:
        if not self._comms:
            return
        if not self._syncing:
            self._accumulated.append(weight)
        elif self._accumulated:
            different = [w for w in self._accumulated if abs(w - weight) > 1e-12 * max(1.0, abs(weight))]
            self._accumulated = []
            if different:
                raise InputError(
                    "Under no_sync() every micro-batch's gradient is summed on this rank and weighted once, at the "
                    "synchronising step, so the micro-batches must be split alike. Received: this rank's shares "
                    f"{different + [weight]}. Give every micro-batch the same global size, or step without no_sync()."
                )
        for comm in self._comms:
            comm.weight = weight

    def declare_loss_weight(self, replica: int, count: float) -> None:
        """`sg.set_loss_weight(count)`: this rank's weight becomes count / (sum of every rank's count)."""
        total = self.cross_worker_sum(torch.tensor(float(count), dtype=torch.float64))
        self._counts = count
        for comm in self._comms:
            comm.weight = count / float(total) if float(total) > 0 else 0.0
        self._batch_norm.weight_declared(0)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """A context whose backward passes accumulate this rank's unsharded gradients without reduce-scattering;
        the first backward after it reduce-scatters the sum (micro-batches must be split alike)."""
        return self._no_sync()

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        models = list(self._shardeds)
        if not models:
            raise InputError("no_sync() needs a distributed model. Received: none yet. Call distribute() first.")
        for model in models:
            model.set_requires_gradient_sync(False)
        self._syncing = False
        try:
            yield
        finally:
            for model in models:
                model.set_requires_gradient_sync(True)
            self._syncing = True

    # ---- across workers ---------------------------------------------------------------------------
    def _check_shards(self, sharded: nn.Module) -> None:
        """Every rank's shard shapes and dtypes against the plan, in one small all-gather before the first step
        (a rank that built another model would otherwise all-gather mismatched shards, or hang)."""
        cw = self._group.cross_worker
        payloads = cw.all_gather_bytes(
            json.dumps(shard_records(sharded.named_parameters())).encode(),
            what="shard shapes and dtypes",
            step=self._steps,
            device=self._group.collective_device,
        )
        check_shards([json.loads(p) for p in payloads], cw.task_names)

    # ---- reports and the end ------------------------------------------------------------------------
    def explain(self) -> Explanation:
        """The worker group, the stage, the units, the exact weighting and the memory plan."""
        decisions = list(self._group.decisions())
        if self._device_decision is not None:
            decisions.append(self._device_decision)
        decisions.append(techniques_line())
        before, after = sharded_decisions(self._stage, check_batches=self._agreement.enabled)
        decisions.extend(before)
        decisions.extend(cut.decision() for cut in self._cuts)
        decisions.extend(after)
        decisions.extend([self._transport, self._host.decision()])
        if self._batch_norm.describe():
            decisions.append(batch_norm_decision("global"))
        decisions.extend(self._input_sharding.decisions())
        details: dict[str, Any] = dict(self._batch_norm.describe())
        for i, plan in enumerate(self._memory.plans):
            which = "" if i == 0 else f" (model {i + 1})"
            details[f"memory plan{which}"] = str(plan)
            against = plan.against_replica()
            if against is not None:
                details[f"memory against a replica{which}"] = against
        replicas = [ReplicaPlacement(self._group.rank, str(self._device), str(self._device))]
        return Explanation(type(self).__name__, self.num_replicas_in_sync, replicas, decisions, details)

    def _close_parts(self) -> None:
        """BatchNorm layers given their forward back, the models let go: the group closes however long the sharded
        model (whose FSDP2 state keeps the process group) lives."""
        self._batch_norm.remove()
        self._model = None
        self._shardeds = []
        self._comms = []
