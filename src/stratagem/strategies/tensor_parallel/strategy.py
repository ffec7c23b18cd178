"""TensorParallelStrategy: each layer's weights split across workers by a layout map (Keras 3's LayoutMap).

One process per worker (`stratagem launch --workers N --strategy tensor_parallel`, torchrun, SLURM, TF_CONFIG),
the same training script as under every strategy. The layout map's mesh (one `model` axis over every worker by
default) is checked against the worker count before any process group exists; the layouts against the model and
its modules before any parameter is placed; then the parameters become DTensors and the forward runs over them
(`apply.py`). On a 2-D mesh ``("data", "model")`` each model group trains on its slice of the global batch and
the gradients are summed across the data axis, weighted by each slice's share (`data_axis.py`).

Exact, as every stratagem strategy is: DTensor's redistributions are deterministic, so the workers of a model
group hold the same bits of every replicated parameter, and the result equals one device's to rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from stratagem import environ
from stratagem.cluster import Cluster, allocator
from stratagem.cluster.worker_group import plan_worker_group
from stratagem.data.split import replica_part
from stratagem.data.worker_shards import WorkerRange
from stratagem.diagnose import PlacementDecision
from stratagem.errors import InputError
from stratagem.strategies.activation_memory import ActivationEstimate, measure_split_step, plan_activations
from stratagem.strategies.data_parallel.distributed import clone_optimizer
from stratagem.strategies.data_parallel.host import LossWeightHost
from stratagem.strategies.explain import Explanation, ReplicaPlacement
from stratagem.strategies.gather import from_bytes, to_bytes
from stratagem.strategies.replica_context import ReplicaContext, enter_replica
from stratagem.strategies.run_inputs import batch_sizes, global_size, replica_weights
from stratagem.strategies.sharded.checkpoint import ShardedStateShards
from stratagem.strategies.sharded.placement import local_device
from stratagem.strategies.tensor_parallel.apply import TensorParallelModel, replicated_plain_tensors
from stratagem.strategies.tensor_parallel.decisions import layout_decisions, layout_table
from stratagem.strategies.tensor_parallel.hooks import (
    BackwardInsideRun,
    refuse_dropout_on_partial_sums,
    replicate_conv_inputs,
)
from stratagem.strategies.tensor_parallel.limit import check_limit
from stratagem.strategies.tensor_parallel.memory import TensorParallelMemoryPlan, plan_tensor_parallel_memory
from stratagem.strategies.tensor_parallel.mesh import (
    MODEL_AXIS,
    DeviceMesh,
    LayoutMap,
    ParameterLayout,
    resolve_layouts,
)
from stratagem.strategies.tensor_parallel.step_bytes import StepBytes
from stratagem.strategies.tensor_parallel.styles import check_splits
from stratagem.strategies.tensor_parallel.techniques import Placing, apply_techniques, check_techniques
from stratagem.strategies.tensor_parallel.tracing import TensorParallelTrace
from stratagem.strategies.worker_group.input import InputSharding
from stratagem.strategies.worker_group.step_agreement import StepAgreement, check_batches_flag
from stratagem.strategies.worker_group.strategy import WorkerGroupStrategy
from stratagem.trace import Recorder, Traceable
from stratagem.trace.recorder import Clock
from stratagem.values import select_replica, stack_replicas, tag_results

AXES = ("data", "model")
"""The mesh axes this strategy knows: `model` splits layers, `data` replicates the model groups."""


def check_mesh_axes(mesh: DeviceMesh) -> None:
    """Refuses a mesh axis other than `data` and `model` (a third technique on the mesh is not supported yet)."""
    unknown = [a for a in mesh.axis_names if a not in AXES]
    if unknown or "model" not in mesh.axis_names:
        raise InputError(
            f"TensorParallelStrategy splits layers along a 'model' axis and replicates them along an optional 'data' "
            f"axis; other axes are not supported yet. Received: shape={mesh.shape}, axis_names={mesh.axis_names}. "
            "Name the axes ('model',) or ('data', 'model')."
        )


class TensorParallelStrategy(WorkerGroupStrategy, LossWeightHost, Traceable):
    """Tensor parallelism on a layout map, over torch's DTensor, exact on any split of the global batch.

    Args:
        layout_map: the `sg.LayoutMap` that says which parameters are split along which mesh axis (None: every
            parameter replicated). Its mesh (default: one `model` axis over every worker) must span the job.
        device: this worker's device (default: the GPU of its local rank, else the CPU).
        cluster: a `Cluster`, a TF_CONFIG-shaped dict, or None to resolve from the environment.
        timeout: seconds any wait (rendezvous, collective) may last before an error naming who is missing.
        check_batches: True (default): when each step function returns, the workers compare a fingerprint of the
            step and of the global batch they were handed (one small all-reduce), and all stop with an `InputError`
            naming the step, the workers and the first input that differs. False: nothing compared.

    Example:
        >>> layout_map = sg.LayoutMap(sg.DeviceMesh((2,), ("model",)))      # under stratagem launch --workers 2
        >>> layout_map[r"mlp\\.c_fc\\.(weight|bias)"] = (None, "model")       # Conv1D (in, out): output features
        >>> layout_map[r"mlp\\.c_proj\\.weight"] = ("model", None)           # input features: partial sums
        >>> strategy = sg.TensorParallelStrategy(layout_map)
        >>> model, optimizer = strategy.distribute(model, torch.optim.AdamW(model.parameters()))
        >>> for batch in strategy.distribute_dataset(loader):
        ...     strategy.run(train_step, args=(batch,))
    """

    samples_steps: ClassVar[bool] = True  # its trace ends every step with Recorder.after_step (fit samples them)

    # Parts, in the order they are applied (torchtitan's parallelize_* order: check, split, then replicate):
    #   mesh       check_mesh_axes, then cluster.worker_group.plan_worker_group: the layout map's mesh (cluster/mesh.py)
    #              against the worker count, before any process group
    #   group      cluster.worker_group: the process group, then its device_mesh(), torch's of the same axes
    #   layouts    mesh.resolve_layouts and styles.check_splits: each parameter's layout, refused by module name
    #   techniques techniques.TECHNIQUES, in order: the split along `model` (apply.py), ZeRO-3 along `data` for
    #              the layouts that name it (data_sharding.py), the weighted sums along `data` (data_axis.py)
    #   optimizer  distributed.clone_optimizer: the user's optimizer over the DTensor parameters
    #   memory     memory.plan_tensor_parallel_memory: this rank's bytes, planned from the layouts before the split;
    #              limit.check_limit: that plan refused, before the split, where it is over the process's memory limit
    #   hooks      hooks.py: convolutions given replicated inputs, a backward outside `run` refused with the fix
    #   input      worker_group.input (WorkerGroupStrategy's): each model group's part of every global batch, the
    #              workers' agreement on the steps, and the batch check (worker_group.step_agreement)

    def __init__(
        self,
        layout_map: LayoutMap | None = None,
        *,
        device: str | torch.device | None = None,
        cluster: Cluster | Mapping[str, Any] | None = None,
        timeout: float = 300.0,
        check_batches: bool = True,
    ) -> None:
        check_batches_flag(check_batches)
        if layout_map is not None and not isinstance(layout_map, LayoutMap):
            raise InputError(
                f"layout_map is a sg.LayoutMap. Received: {type(layout_map).__name__}. "
                "Build one with sg.LayoutMap(sg.DeviceMesh(shape, axis_names)) and set its keys."
            )
        self._layout_map = layout_map if layout_map is not None else LayoutMap()
        if self._layout_map.mesh is not None:
            check_mesh_axes(self._layout_map.mesh)
        env = environ.current()
        # Before the model is built, as ShardedStrategy does: the whole tensors distribute frees, the gradients and
        # the step's tensors then leave the resident set at once, which the memory plan assumes (memory.py).
        self._allocator = allocator.map_large_blocks_here(env)
        # The plan checks the mesh's product against the worker count before any process group: a wrong one fails
        # here, alone. No mesh: one `model` axis over every worker.
        plan = plan_worker_group(cluster, timeout=timeout, env=env, mesh=self._layout_map.mesh, default_axis=MODEL_AXIS)
        self._mesh = plan.mesh
        self._device_decision: PlacementDecision | None = None
        if device is None:
            device, self._device_decision = local_device(plan.cluster, env)
        self._device = torch.device(device)
        self._join_group(plan, [self._device], env=env)
        try:
            self._torch_mesh = self._group.device_mesh()  # torch's DeviceMesh of the plan's shape and axis names
        except BaseException:
            self._group.close(release=False)
            raise
        self._num_data = self._mesh.axis_size("data")
        self._data_index = self._group.rank // self._mesh.axis_size("model")
        self._data_group = self._torch_mesh["data"].get_group() if "data" in self._mesh.axis_names else None
        self._model_group = self._torch_mesh["model"].get_group() if self._mesh.axis_size("model") > 1 else None
        self._layouts: list[ParameterLayout] = []
        self._kinds: dict[str, str] = {}
        self._grad_hooks: list[Any] = []
        self._weight = 1.0
        self._counts: float | None = None
        self._steps = 0
        self._plan: TensorParallelMemoryPlan | None = None
        self._activations: ActivationEstimate | None = None
        self._step_bytes: str | None = None  # the model axis's collectives of a step, once measured
        self._agreement = StepAgreement(self._group, enabled=check_batches, strategy=type(self).__name__)
        self._batch_agreement = self._agreement.batch
        self._input_sharding = InputSharding()
        # One for the strategy's life: its asynchronous saves' process group is made once.
        self._state_shards = ShardedStateShards(self._group)
        self._trace = TensorParallelTrace(self._group, self._torch_mesh, step=lambda: self._steps, env=env)
        self._finish_building()

    # ---- Strategy ---------------------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        """The model's replicas: the size of the `data` axis (1 on a mesh of one `model` axis)."""
        return self._num_data

    @property
    def mesh(self) -> DeviceMesh:
        """The mesh the layouts are placed on (the layout map's, or one `model` axis over every worker)."""
        return self._mesh

    @property
    def holds_whole_state(self) -> bool:
        """False: a split parameter's whole value is on no one worker."""
        return False

    def state_shards(self) -> ShardedStateShards:
        """Each worker saves and loads its own parts with torch.distributed.checkpoint, as ShardedStrategy's ranks do
        (`sharded/checkpoint.py`: DTensors of any placement), so a backup resumes at another layout or worker count
        (DCP reads each part from the pieces it was written as) and `stratagem checkpoint export` reads it whole."""
        return self._state_shards

    def distribute(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """`model`'s parameters replaced in place by DTensors of their layouts, and `optimizer` rebuilt over them.

        Refused before anything is placed: a layout naming an axis not in the mesh, a layout whose length is not
        its tensor's, tied parameters of different layouts, a split a module's forward cannot honour (styles.py).
        """
        if self._layouts:
            raise InputError(
                "TensorParallelStrategy distributes one model. Received: a second distribute(). "
                "Build a strategy per model, or distribute the models as one module."
            )
        named = [(n, p, tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=False)]
        layouts = resolve_layouts(self._layout_map, self._mesh, named)
        # The techniques in their order (techniques.py): the split, ZeRO-3 along `data`, the data axis's sums.
        placing = Placing(
            model=model, mesh=self._mesh, torch_mesh=self._torch_mesh, layouts=layouts, weight=lambda: self._weight
        )
        check_techniques(placing)  # each technique's refusals (data_sharding.py's, say), by name, before any placing
        self._kinds = check_splits(model, layouts, self._mesh)
        model.to(self._device)
        # The plan is for the parameters as the user built them, before any is replaced by its part.
        self._plan = self._plan_for(layouts, model, optimizer)
        # Before anything is split: a plan over this process's memory limit is refused here, not by the kernel.
        params = dict(model.named_parameters(remove_duplicate=False))
        check_limit(self._plan, layouts, params, optimizer, mesh=self._mesh, device=self._device)
        made = apply_techniques(placing)
        self._grad_hooks = list(placing.parts)
        self._grad_hooks += replicate_conv_inputs(model, placing.parameters_mesh)  # the parameters' own mesh
        self._grad_hooks += refuse_dropout_on_partial_sums(model)  # named before DTensor fails inside the dropout
        self._grad_hooks.append(BackwardInsideRun(model))  # said before torch stops in the middle of a backward
        self._layouts = layouts
        wrapped = TensorParallelModel(model, "TensorParallelModel")
        self._model = wrapped
        self._trace.add(wrapped)  # forward and the start of backward, while a trace records (tracing.py)
        if optimizer is None:
            return wrapped
        return wrapped, self._trace.watch_optimizer(clone_optimizer(optimizer, made))

    def memory_plan(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        example_inputs: Any = None,
        activations: int | None = None,
    ) -> TensorParallelMemoryPlan:
        """Bytes this rank holds by category, and `total`, its peak over the resident set before the model
        (memory.py gives the formulas).

        After `distribute`: the plan made then; before it, the plan for `model` and `optimizer` as they would be
        split. The step's activations count when given: `activations` (this rank's bytes), or, after `distribute`,
        `example_inputs` (one GLOBAL batch: one forward and backward of the split model on this model group's
        part, run by every worker together), kept for the later plans.

        Example:
            >>> model, optimizer = strategy.distribute(model, torch.optim.AdamW(model.parameters()))
            >>> plan = strategy.memory_plan(example_inputs={"input_ids": ids, "labels": ids})   # on every worker
        """
        if example_inputs is not None and (model is not None or self._model is None):
            raise InputError(
                "TensorParallelStrategy measures example_inputs on the split model, every worker together. "
                f"Received: example_inputs with {'a model' if model is not None else 'no model distributed yet'}. "
                "Call strategy.memory_plan(example_inputs=...) on every worker after distribute, or give this "
                "rank's bytes: memory_plan(model, optimizer, activations=...)."
            )
        if example_inputs is not None:
            # The same step counts the model axis's collectives with their bytes, for explain() (step_bytes.py).
            axes = {str(self._torch_mesh[name].get_group().group_name): name for name in self._mesh.axis_names}
            counting = StepBytes(axes)

            @contextlib.contextmanager
            def around() -> Iterator[None]:
                with replicated_plain_tensors(), counting:
                    yield

            part = replica_part(example_inputs, self._num_data, self._data_index)
            self._activations = measure_split_step(self._model, part, around)
            self._step_bytes = counting.summary() or "none"
        else:
            self._activations = plan_activations(None, None, activations, lambda b: b) or self._activations
        if model is not None:
            named = [(n, p, tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=False)]
            return self._plan_for(resolve_layouts(self._layout_map, self._mesh, named), model, optimizer)
        if self._plan is None:
            raise InputError(
                "memory_plan() needs the model until distribute() has run. Received: no model. "
                "Call strategy.memory_plan(model, optimizer), or distribute first."
            )
        if self._activations is not None:
            how = self._activations.how
            self._plan = replace(self._plan, activations=self._activations.peak, activations_how=how)
        return self._plan

    def _plan_for(
        self, layouts: list[ParameterLayout], model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> TensorParallelMemoryPlan:
        estimate = self._activations
        return plan_tensor_parallel_memory(
            layouts,
            dict(model.named_parameters(remove_duplicate=False)),
            optimizer,
            mesh=self._mesh,
            rank=self._group.rank,
            activations=0 if estimate is None else estimate.peak,
            activations_how=None if estimate is None else estimate.how,
            allocator=self._allocator[1] if self._allocator[0] else f"not planned for: {self._allocator[1]}",
        )

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """Runs `fn` on this model group's slice; backward sums its gradients across the data axis, weighted."""
        kwargs = dict(kwargs or {})
        args = tuple(args)
        sizes = batch_sizes(args, kwargs, 1)
        total = global_size(args, kwargs)
        self._weight = replica_weights(sizes, total, 1, self._num_data)[0]
        local_args, local_kwargs = select_replica((args, kwargs), 0)
        self._counts = None
        ctx = ReplicaContext(self._data_index, self._num_data, self._device, self, host=self)
        previous = enter_replica(ctx)
        started = self._trace.step_started()
        self._agreement.start(self._steps + 1)
        try:
            # The whole step, not the forward alone: backward replays ops whose saved plain tensors (the labels of
            # a loss) meet DTensor gradients, and DTensor takes them as replicated only while this is on.
            with replicated_plain_tensors(), self._trace.recording():
                result = fn(*local_args, **local_kwargs)
        except BaseException:
            self._agreement.drop()
            raise
        finally:
            enter_replica(previous)
            self._steps += 1
        self._agreement.finish()  # every worker's fingerprint of the step's batch, compared (step_agreement.py)
        self._trace.step_ended(started)
        stacked = stack_replicas([result], sizes, total)
        return tag_results(stacked, None if self._counts is None else [self._counts])

    def trace(
        self, directory: str | Path, *, clock: Clock | None = None, mode: str = "spans"
    ) -> AbstractContextManager[Recorder]:
        """Records the steps run inside the block on every worker: forward, backward, optimizer step, each collective
        DTensor issues and each sum of the data axis (tracing.py; docs/trace.md). Every worker enters it at the same
        point.

        Example:
            >>> with strategy.trace("traces/"):
            ...     strategy.run(train_step, args=(x, y))
        """
        return self._trace.trace(directory, clock=clock, mode=mode)

    def _input_timing(self) -> tuple[None, Recorder]:
        return None, self._trace.recorder  # input spans while a trace records; stragglers are not judged here

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """On a mesh of one `model` axis, nothing to skip: the backward passes accumulate each worker's parts, and
        `fit(accumulate_steps=K)` trains as one device does. With a `data` axis: refused (not supported yet)."""
        if self._data_group is not None:
            raise InputError(
                "Accumulating gradients over several backward passes on a 'data' axis (no_sync, fit's "
                "accumulate_steps) is not supported yet by TensorParallelStrategy. Received: no_sync() on the mesh "
                f"{self._mesh.shape} {self._mesh.axis_names}. Use accumulate_steps=1 with a larger global batch, or "
                "a mesh of one 'model' axis."
            )
        return contextlib.nullcontext()

    def declare_loss_weight(self, replica: int, count: float) -> None:
        """`sg.set_loss_weight(count)`: this group's weight becomes count / (sum over the data axis)."""
        total = float(self._data_sum(torch.tensor(float(count), dtype=torch.float64)))
        self._counts = float(count)
        self._weight = float(count) / total if total > 0 else 0.0

    # ---- across workers: the data axis ----------------------------------------------------------
    # A reduce or gather across workers is one across the model's replicas, the `data` axis: the workers of a model
    # group hold the same values (a step's loss is whole on each), so summing over all of them would count each
    # `model`-axis size times.
    def _worker_range(self) -> WorkerRange:
        return WorkerRange(self._num_data, self._data_index, 1)

    def _leads_its_part(self) -> bool:
        return self._group.rank % self._mesh.axis_size("model") == 0

    def cross_worker_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.detach().clone().to(self._group.collective_device)
        if self._model_group is not None:
            import torch.distributed as dist

            # The workers of a model group hold the same values but one: fit's stop request, which each samples at
            # its own moment (a SIGTERM reaching one worker before a step, another during it); summed across `data`
            # alone, one worker stopped after the step and the other went on to the next, each in the other's
            # collectives. The max leaves equal values as they are and makes that one agree.
            dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self._model_group)
        return self._data_sum(out)

    def _data_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.detach().clone().to(self._group.collective_device)
        if self._data_group is not None:
            import torch.distributed as dist

            dist.all_reduce(out, group=self._data_group)
        return out

    def gather_across_workers(self, items: list[Any]) -> list[Any]:
        if self._data_group is None:
            return items
        import torch.distributed as dist

        payloads: list[Any] = [None] * self._num_data
        dist.all_gather_object(payloads, to_bytes(items), group=self._data_group)
        out: list[Any] = []
        for index, payload in enumerate(payloads):
            out.extend(items if index == self._data_index else from_bytes(payload, f"data group {index}"))
        return out

    # ---- reports and the end ------------------------------------------------------------------------
    def explain(self) -> Explanation:
        """The worker group, the mesh, each parameter's layout and the redistributions a step implies."""
        decisions = list(self._group.decisions())
        if self._device_decision is not None:
            decisions.append(self._device_decision)
        decisions.extend(layout_decisions(self._mesh, self._layouts, self._step_bytes))
        decisions.extend(self._input_sharding.decisions())
        details: dict[str, Any] = {"layouts": layout_table(self._layouts, self._kinds)} if self._layouts else {}
        if self._plan is not None:
            details["memory plan"] = str(self._plan)
        replicas = [ReplicaPlacement(self._data_index, str(self._device), str(self._device))]
        return Explanation(type(self).__name__, self.num_replicas_in_sync, replicas, decisions, details)

    def _close_parts(self) -> None:
        for hook in self._grad_hooks:
            hook.remove()
        self._grad_hooks = []
        self._model = None
