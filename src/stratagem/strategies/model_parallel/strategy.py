"""ModelParallelStrategy: one model split across devices, for a model too large for one.

Two ways to give the split:

- `stages=[...]`: the layers of an `nn.Sequential` are cut into consecutive stages, one per
  device (where to cut: `split_points`, or by default balanced by parameter count). A batch can be
  cut into `num_micro_batches` that flow through the stages concurrently on the GPipe schedule
  (see strategies/model_parallel/pipeline.py): stage s works on micro-batch m while stage s+1 works on m-1.
- `placement={"encoder": "cuda:0", "head": "cuda:1"}`: named sub-modules of any model go to
  devices. Each placed module computes on its device: its inputs are moved there, its outputs are
  moved back to the device of the code that called it (the enclosing placed module's, or the
  model's own). The model's forward runs as written, so there are no stages to pipeline.

How a model is cut into stages or grouped by placement, and the hooks that move tensors between
devices, are in strategies/model_parallel/split.py; this module checks the arguments, records the
decisions and builds the pipeline or the placed model.

There is one copy of the model, so `num_replicas_in_sync` is 1 and the training step is the one
every other strategy runs. The model's output is on the last stage's device (the model's own
device with `placement=`), and `distribute_dataset` puts batches there too, so targets meet the
output; the model moves its input to the first stage itself.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from stratagem import devices as sg_devices
from stratagem import diagnose
from stratagem.diagnose import MemoryEstimate, PlacementDecision
from stratagem.errors import InputError, MemoryEstimateError
from stratagem.strategies.base import Strategy
from stratagem.strategies.data_parallel.placement import share_intra_op_threads
from stratagem.strategies.explain import Explanation, ReplicaPlacement
from stratagem.strategies.model_parallel.pipeline import Pipeline, PipelineModel, ScheduleEvent
from stratagem.strategies.model_parallel.split import ROOT, group_placement, place_modules, split_sequential
from stratagem.strategies.replica_context import ReplicaContext, enter_replica
from stratagem.strategies.wrapped_model import WrappedModel
from stratagem.timeouts import check_seconds
from stratagem.trace import Recorder, Traceable
from stratagem.trace.recorder import Clock
from stratagem.trace.traceable import record_alone
from stratagem.values import select_replica

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StageInfo:
    """One stage of the split: its device, its modules, its parameters and the memory they need.

    Example:
        >>> [(s.device, s.modules, s.num_parameters) for s in strategy.stage_map()]
        [('cpu:0', ('0', '1'), 112), ('cpu:1', ('2', '3', '4'), 340)]
    """

    stage: int
    device: str
    """The logical device, e.g. "cuda:1" or "cpu:0"."""
    physical: str
    """The torch device the stage really runs on."""
    modules: tuple[str, ...]
    """The names of the modules of this stage, as in the model's `named_modules()` ("" is the model itself)."""
    num_parameters: int
    memory: MemoryEstimate | None
    """Parameters + gradients + optimizer state on this device (None before `distribute`)."""
    parameters: tuple[nn.Parameter, ...] = dataclasses.field(default=(), repr=False, compare=False)

    def describe(self) -> str:
        where = self.device if self.physical == self.device else f"{self.device} (runs on {self.physical})"
        if not self.modules:
            return f"{where}: modules assigned when a model is distributed"
        names = ", ".join(repr(m) if m else "(the model itself)" for m in self.modules)
        memory = f"; {self.memory.describe()}" if self.memory is not None else ""
        return f"{where}: modules {names}; {self.num_parameters:,} parameters{memory}"


_PLACED_COPY_REFUSED = (
    "A model placed module by module cannot be saved whole, pickled or deep-copied: its placed modules carry the "
    "hooks that move tensors between their devices, which a plain pickle of the model would not hold (and "
    "torch.load(weights_only=True) refuses). Received: torch.save, pickle or copy.deepcopy of the ModelParallelModel "
    "that distribute() handed back, built with placement=. Save model.state_dict() and load it into a model built "
    "as before, or build the strategy with stages= (a pipeline), whose model pickles as your nn.Sequential."
)


class ModelParallelStrategy(Strategy, Traceable):
    """Splits one model across devices; optionally pipelines micro-batches through the stages (GPipe).

    Args:
        stages: one device per stage of an `nn.Sequential` (TF or torch spelling).
        split_points: with `stages`, the index of the layer each stage after the first starts at
            (`[2]`: layers 0-1, then 2-end). Default: balanced by parameter count.
        placement: instead of `stages`, a mapping of module names (as in `named_modules()`) to
            devices, for any model; `""` names the model itself (default: the first device given).
        num_micro_batches: with `stages`, how many micro-batches each batch is cut into (a batch
            smaller than this gives one example per micro-batch). 1: the stages run one after another.
        timeout: seconds to wait for a stage before failing with an error naming it.
        intra_op_threads: torch intra-op threads per CPU stage thread (default: the process's
            threads shared among the CPU stages).

    With micro-batches, every layer must treat the examples of a batch independently and keep the
    batch dimension first (BatchNorm is refused; use num_micro_batches=1 or GroupNorm/LayerNorm);
    random layers such as dropout draw their numbers in the order the stage threads run, so they
    do not repeat one device's draws.

    Example:
        >>> strategy = sg.ModelParallelStrategy(["cuda:0", "cuda:1"], num_micro_batches=4)
        >>> model, optimizer = strategy.distribute(nn.Sequential(...), torch.optim.Adam(...))
        >>> for x, y in strategy.distribute_dataset(loader):     # batches on cuda:1, with the output
        ...     loss = strategy.run(train_step, args=(x, y))
        >>> print(strategy.explain())                              # the stage map
    """

    samples_steps: ClassVar[bool] = True  # `run` ends every step with Recorder.after_step (fit samples them)

    def __init__(
        self,
        stages: Sequence[str | torch.device] | None = None,
        *,
        split_points: Sequence[int] | None = None,
        placement: Mapping[str, str | torch.device] | None = None,
        num_micro_batches: int = 1,
        timeout: float = 300.0,
        intra_op_threads: int | None = None,
        registry: sg_devices.DeviceRegistry | None = None,
    ) -> None:
        timeout = check_seconds("timeout", timeout)
        if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int) or num_micro_batches < 1:
            raise InputError(
                f"num_micro_batches must be a whole number >= 1. Received: num_micro_batches={num_micro_batches!r}. "
                "Use 1 for no pipelining, or e.g. 4 to cut each batch into 4 micro-batches."
            )
        if (stages is None) == (placement is None):
            raise InputError(
                "ModelParallelStrategy needs exactly one way to split the model. Received: "
                f"stages={_show(stages)}, placement={_show(placement)}. Give stages=['cuda:0', 'cuda:1'] for the "
                "layers of an nn.Sequential, or placement={'encoder': 'cuda:0', 'head': 'cuda:1'} for any model."
            )
        self._timeout = float(timeout)
        self._num_micro_batches = num_micro_batches
        self._decisions: list[PlacementDecision] = []
        self._placement: dict[str, sg_devices.LogicalDevice] | None = None
        self._split_points = None
        if stages is not None:
            self._stage_devices = sg_devices.resolve_devices(stages, registry=registry)
            self._split_points = self._check_split_points(split_points)
            self._check_one_stage_per_gpu()
            self._output = self._stage_devices[-1]
            self._decisions.append(
                PlacementDecision(
                    subject="stages", choice=", ".join(d.name for d in self._stage_devices), reason="given by stages="
                )
            )
        else:
            self._placement = self._resolve_placement(placement, split_points, registry)
            self._stage_devices = list({d.name: d for d in self._placement.values()}.values())
            self._output = self._placement[ROOT]
        self._decisions.append(self._micro_batch_decision())
        self._decisions.append(
            PlacementDecision(
                subject="input and output device",
                choice=self._output.name,
                reason=(
                    (
                        "the last stage's device, where the model's output is"
                        if stages is not None
                        else "the model's own device, where its forward returns its output"
                    )
                    + "; distribute_dataset puts batches (inputs and targets) there, and the model moves its "
                    "input to the modules that need it"
                ),
            )
        )
        self._threads_per_stage = self._choose_threads(intra_op_threads)
        self._stages: list[StageInfo] = [
            StageInfo(s, d.name, str(d.physical), (), 0, None) for s, d in enumerate(self._stage_devices)
        ]
        self._pipeline: Pipeline | None = None
        self._recorder = Recorder(rank=0, task="worker:0")  # off until a trace starts (stratagem.trace)
        self._steps = 0
        self._hooks: list[Any] = []
        self._model: nn.Module | None = None

    # ---- construction checks ------------------------------------------------------------------
    def _check_split_points(self, split_points: Sequence[int] | None) -> list[int] | None:
        if split_points is None:
            return None
        num_stages = len(self._stage_devices)
        points = (
            list(split_points) if isinstance(split_points, Sequence) and not isinstance(split_points, str) else None
        )
        if (
            points is None
            or len(points) != num_stages - 1
            or not all(isinstance(p, int) and not isinstance(p, bool) for p in points)
            or any(b <= a for a, b in zip([0] + points, points))
        ):
            raise InputError(
                f"split_points must list, in increasing order, the layer index where each of stages 1..{num_stages - 1} "
                f"starts: {num_stages - 1} whole number(s) >= 1 for {num_stages} stages. Received: "
                f"split_points={split_points!r}. E.g. split_points=[2] puts layers 0-1 on {self._stage_devices[0].name} "
                "and the rest on the next stage; leave it out to balance by parameter count."
            )
        return points

    def _check_one_stage_per_gpu(self) -> None:
        gpus = [d.physical for d in self._stage_devices if d.physical.type == "cuda"]
        shared = sorted({str(g) for g in gpus if gpus.count(g) > 1})
        if shared:
            names = ", ".join(d.name for d in self._stage_devices)
            raise InputError(
                f"A pipeline runs at most one stage per physical GPU. Received: stages on logical GPUs that share "
                f"{', '.join(shared)} ({names}). torch runs the backward passes of one GPU on a single thread, so two "
                "stages there cannot overlap and would wait for each other. Merge those stages into one, or put "
                "them on different GPUs."
            )

    def _resolve_placement(
        self, placement: Any, split_points: Any, registry: sg_devices.DeviceRegistry | None
    ) -> dict[str, sg_devices.LogicalDevice]:
        if not isinstance(placement, Mapping) or not placement or not all(isinstance(k, str) for k in placement):
            raise InputError(
                f"placement must map module names to devices. Received: placement={placement!r}. Use e.g. "
                "placement={'encoder': 'cuda:0', 'head': 'cuda:1'} (names as in model.named_modules())."
            )
        if split_points is not None:
            raise InputError(
                f"split_points cuts the layers of stages=, not a placement. Received: split_points={split_points!r} "
                "with placement=. Drop split_points, or give stages= for an nn.Sequential."
            )
        if self._num_micro_batches > 1:
            raise InputError(
                "Micro-batches flow through the stages of an nn.Sequential; with placement= the model's own forward "
                f"runs, which has no stages to pipeline. Received: num_micro_batches={self._num_micro_batches} with "
                "placement=. Use num_micro_batches=1, or stages=[...] with the model written as an nn.Sequential."
            )
        resolved = {
            name: sg_devices.resolve_devices([device], registry=registry)[0] for name, device in placement.items()
        }
        if ROOT in resolved:
            why = "given by placement['']"
        else:
            first = next(iter(resolved.values()))
            resolved = {ROOT: first, **resolved}
            why = (
                "the first device of placement=; the model's own code and any module not named in placement= "
                "run there (add '' to placement= to choose)"
            )
        self._decisions.append(
            PlacementDecision(
                subject="placement",
                choice=", ".join(f"{n or '(the model itself)'} -> {d.name}" for n, d in resolved.items()),
                reason=f"given by placement=; the model itself on {resolved[ROOT].name}: {why}",
            )
        )
        return resolved

    def _micro_batch_decision(self) -> PlacementDecision:
        m = self._num_micro_batches
        if self._placement is not None:
            return PlacementDecision(
                subject="micro-batches",
                choice="1",
                reason="placement= runs the model's own forward: modules run one after another",
            )
        if m == 1:
            reason = (
                "num_micro_batches=1: each batch goes through the stages whole, one stage after another "
                "(no overlap; give num_micro_batches > 1 to pipeline)"
            )
        else:
            reason = (
                f"num_micro_batches={m}: GPipe schedule, every forward then every backward; stage s works on "
                "micro-batch m while stage s+1 works on m-1, and gradients accumulate over the micro-batches. "
                "The loss is computed on the whole output, so the update equals one device's"
            )
        return PlacementDecision(subject="micro-batches", choice=str(m), reason=reason)

    def _choose_threads(self, intra_op_threads: int | None) -> int | None:
        if intra_op_threads is not None:
            if isinstance(intra_op_threads, bool) or not isinstance(intra_op_threads, int) or intra_op_threads < 1:
                raise InputError(
                    f"intra_op_threads must be at least 1. Received: intra_op_threads={intra_op_threads!r}."
                )
            if self._placement is not None:
                raise InputError(
                    "intra_op_threads sets the torch threads of each pipeline stage's thread; with placement= the "
                    f"model runs on the caller's thread. Received: intra_op_threads={intra_op_threads} with placement=. "
                    "Drop it, and call torch.set_num_threads() yourself if needed."
                )
        num_cpu = sum(1 for d in self._stage_devices if d.physical.type == "cpu")
        if num_cpu == 0 or self._placement is not None:
            return None
        threads, why = share_intra_op_threads(num_cpu, intra_op_threads, "stage")
        self._decisions.append(
            PlacementDecision(subject="intra-op threads per CPU stage", choice=str(threads), reason=why)
        )
        return threads

    # ---- the Strategy vocabulary --------------------------------------------------------------
    @property
    def local_devices(self) -> list[torch.device]:
        return [self._output.physical]

    def stage_map(self) -> list[StageInfo]:
        """Per stage (per device with `placement=`): device, modules, parameter count and memory."""
        return list(self._stages)

    def last_schedule(self) -> list[ScheduleEvent]:
        """The events of the last forward and backward pass, in the order they happened (empty before one)."""
        run = self._pipeline.last_run if self._pipeline is not None else None
        return list(run.events) if run is not None else []

    def explain(self) -> Explanation:
        details: dict[str, Any] = {}
        label = "stage" if self._placement is None else "device"
        for info in self._stages:
            details[f"{label} {info.stage}"] = info.describe()
        replicas = [ReplicaPlacement(0, self._output.name, str(self._output.physical))]
        return Explanation(type(self).__name__, 1, replicas, list(self._decisions), details)

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """Runs `fn(*args, **kwargs)` once (one model copy); the model inside it runs across the stages."""
        if not callable(fn):
            raise InputError(f"run() needs a function to call. Received: {type(fn).__name__}.")
        previous = enter_replica(ReplicaContext(0, 1, self._output.physical, self))
        self._steps += 1
        recorder = self._recorder
        started = recorder.now() if recorder.on else None
        recorder.at_step(self._steps)
        caller_threads = torch.get_num_threads()
        if self._threads_per_stage is not None and self._output.physical.type == "cpu":
            # The caller's thread runs the last stage's backward while the stage threads work.
            torch.set_num_threads(self._threads_per_stage)
        try:
            return fn(*select_replica(tuple(args), 0), **select_replica(dict(kwargs or {}), 0))
        finally:
            enter_replica(previous)
            if torch.get_num_threads() != caller_threads:
                torch.set_num_threads(caller_threads)
            if started is not None and recorder.on:
                recorder.span("step", f"step {self._steps}", started, recorder.now())
            if recorder.recording:
                recorder.after_step(self._steps)  # a sampled trace (fit's default) decides whether the next records

    @contextlib.contextmanager
    def trace(self, directory: str | Path, *, clock: Clock | None = None, mode: str = "spans") -> Iterator[Recorder]:
        """Records the steps run inside the block: each step on the calling thread's track, and with a pipeline
        each stage's forward and backward of each micro-batch on the stage's track ("stage <s>"), from which
        `stratagem trace summary` measures the bubble beside GPipe's (S-1)/(M+S-1). Writes
        `directory`/worker-0.json at its end.

        Example:
            >>> with strategy.trace("traces/"):
            ...     strategy.run(train_step, args=(x, y))
        """
        with record_alone(self._recorder, directory, clock=clock, mode=mode) as recorder:
            yield recorder

    def __repr__(self) -> str:
        if self._placement is not None:
            return f"ModelParallelStrategy(placement={ {n: d.name for n, d in self._placement.items()} })"
        return (
            f"ModelParallelStrategy(stages={[d.name for d in self._stage_devices]}, "
            f"num_micro_batches={self._num_micro_batches})"
        )

    def close(self) -> None:
        """Stops the stage threads (the model stays usable: they start again when it is called)."""
        if self._pipeline is not None:
            self._pipeline.close()

    # ---- distribute ---------------------------------------------------------------------------
    def distribute(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Moves each part of `model` to its device; returns `(model, optimizer)` (the model alone without one).

        With `stages=` the model returned runs the pipeline and has the same `state_dict()` keys as
        the `nn.Sequential` given; with `placement=` it runs the model given, with its placed modules moved.
        Either is the returned model's `.module` (as under DDP); calls, parameters and state go to it.
        """
        self._check_distribute_args(model, optimizer, self._model)
        decisions: list[PlacementDecision] = []
        if self._placement is None:
            groups, split = split_sequential(model, self._stage_devices, self._split_points, self._num_micro_batches)
            decisions.append(split)
        else:
            groups = group_placement(model, self._placement)
        stages = [
            self._stage_info(s, device, names, params, optimizer) for s, (device, names, params) in enumerate(groups)
        ]
        self._check_memory(stages)
        # Recorded only now: a refused model leaves the strategy as it was.
        self._stages = stages
        self._decisions.extend(decisions)
        for info in stages:
            logger.info("%s %d: %s", "stage" if self._placement is None else "device", info.stage, info.describe())
        if self._placement is None:
            distributed = self._build_pipeline(model)
        else:
            self._hooks.extend(place_modules(model, self._placement))
            distributed = model
        if optimizer is not None and optimizer.state and any(d.physical.type != "cpu" for d in self._stage_devices):
            optimizer.load_state_dict(optimizer.state_dict())  # moves existing state next to its parameter
        # Behind a wrapper whose `.module` is the pipeline or the placed model, as DDP's (wrapped_model.py). Its pickle
        # is the user's nn.Sequential (the pipeline runs its layers); a placed model's modules carry the hooks that
        # move tensors between devices, functions of stratagem that no plain pickle holds.
        refused = None if self._placement is None else _PLACED_COPY_REFUSED
        self._model = WrappedModel(distributed, "ModelParallelModel", plain=model, copy_refused=refused)
        return self._model if optimizer is None else (self._model, optimizer)

    def _stage_info(
        self,
        stage: int,
        device: sg_devices.LogicalDevice,
        names: list[str],
        params: list[nn.Parameter],
        optimizer: torch.optim.Optimizer | None,
    ) -> StageInfo:
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        state = diagnose.estimate_training_memory(trainable, optimizer)
        memory = MemoryEstimate(
            parameter_bytes=param_bytes,
            gradient_bytes=trainable,
            optimizer_state_bytes=state.optimizer_state_bytes,
            optimizer=state.optimizer,
        )
        return StageInfo(
            stage,
            device.name,
            str(device.physical),
            tuple(names),
            sum(p.numel() for p in params),
            memory,
            tuple(params),
        )

    def _check_memory(self, stages: list[StageInfo]) -> None:
        """Before anything is copied: does each GPU have room for its stage's training state?"""
        devices = {d.name: d for d in self._stage_devices}
        for info in stages:
            known = devices[info.device].memory_room()
            if known is None or info.memory is None:
                continue
            room, what = known
            if info.memory.total_bytes > room:
                raise MemoryEstimateError(
                    f"Stage {info.stage} on {info.device} (modules {list(info.modules)}) needs at least "
                    f"{info.memory.describe()}, but {what} is {diagnose.format_bytes(room)}. Options: more stages, "
                    "a split that moves layers to a GPU with room (split_points= or placement=), or an optimizer "
                    "with less state (SGD keeps none)."
                )

    def _build_pipeline(self, model: nn.Module) -> nn.Module:
        children = dict(model.named_children())
        stage_modules = []
        for info, device in zip(self._stages, self._stage_devices):
            stage = nn.Sequential(collections.OrderedDict((name, children[name]) for name in info.modules))
            stage_modules.append(stage.to(device.physical))
        self._pipeline = Pipeline(
            stage_modules,
            [d.physical for d in self._stage_devices],
            [d.name for d in self._stage_devices],
            num_micro_batches=self._num_micro_batches,
            timeout=self._timeout,
            threads_per_stage=self._threads_per_stage,
            strategy=self,
        )
        self._pipeline.recorder = self._recorder
        return PipelineModel(model, self._pipeline)


def _show(value: Any) -> str:
    return "None" if value is None else repr(value)
