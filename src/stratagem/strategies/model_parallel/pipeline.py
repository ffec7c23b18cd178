"""The GPipe schedule: stages on their own threads, micro-batches flowing through them.

A batch is cut along its first dimension into micro-batches (sizes differing by at most one).
Each stage owns a persistent thread. Forward: stage 0 takes micro-batches 0, 1, 2, ... in
turn and hands each output (detached, moved to the next stage's device) to stage 1, so stage s
works on micro-batch m while stage s+1 works on m-1. The last stage's outputs are concatenated
into the model's output, on the last stage's device.

Backward: the user's `loss.backward()` runs the last stage's backward, whose graph hangs on the
output. As soon as the gradient of micro-batch m reaches the last stage's input, it is handed to
the previous stage's thread, which runs that stage's backward for m while the last stage goes on
with the next micro-batch; and so on down to stage 0. An autograd callback makes
`loss.backward()` return only when every stage has finished, so clipping and the optimizer see
gradients accumulated over all micro-batches.

Why this is exact: the loss is computed on the whole, concatenated output, so each micro-batch
receives its rows of the full batch's output gradient, and the parameter gradients summed over
the micro-batches are the full batch's, whatever the loss and however the batch splits. Only
modules that mix examples of a batch (BatchNorm) see a difference; the strategy refuses those
with more than one micro-batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from stratagem.data.split import split_sizes
from stratagem.diagnose.placement import apply_placement, capture_placement
from stratagem.errors import CollectiveTimeoutError, InputError
from stratagem.strategies.replica_context import ReplicaContext, enter_replica
from stratagem.trace import Recorder

if TYPE_CHECKING:
    from stratagem.strategies.base import Strategy


@dataclasses.dataclass(frozen=True)
class ScheduleEvent:
    """One step of the schedule: a stage starting or ending its work on one micro-batch.

    Example:
        >>> ScheduleEvent("forward", 1, 0, "start")     # stage 1 starts the forward of micro-batch 0
    """

    phase: Literal["forward", "backward"]
    stage: int
    micro_batch: int
    edge: Literal["start", "end"]


class _StageThread:
    """A persistent thread that runs one stage's jobs in the order they arrive."""

    def __init__(self, name: str, setup: Callable[[], None]) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, args=(setup,), name=name, daemon=True)
        self.thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._inbox.put(job)

    def _serve(self, setup: Callable[[], None]) -> None:
        setup()
        while True:
            job = self._inbox.get()
            if job is None:
                return
            job()  # a job catches its own errors and hands them to its run

    def stop(self, timeout: float) -> None:
        self._inbox.put(None)
        self.thread.join(timeout=timeout)


class _Run:
    """One forward call and its backward: what each stage keeps, and how far each stage got."""

    def __init__(self, num_stages: int, sizes: list[int], grad_enabled: bool, recorder: Recorder | None = None) -> None:
        self.sizes = sizes
        self.grad_enabled = grad_enabled
        num_micro = len(sizes)
        self.inputs: list[list[torch.Tensor | None]] = [[None] * num_micro for _ in range(num_stages)]
        self.outputs: list[list[torch.Tensor | None]] = [[None] * num_micro for _ in range(num_stages)]
        self.forward_done = [0] * num_stages
        self.backward_done = [0] * num_stages
        self.grad_sent = [False] * num_micro
        self.events: list[ScheduleEvent] = []
        self.recorder = recorder
        """Where each stage's work on each micro-batch is a span while it records (`stratagem.trace`)."""
        self.started: dict[tuple[str, int, int], int] = {}
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        # Autocast is thread-local: the stage threads must compute as the caller's thread would.
        self.autocast = [
            (kind, torch.get_autocast_dtype(kind)) for kind in ("cuda", "cpu") if torch.is_autocast_enabled(kind)
        ]
        # So is the placement log (sg.log_placement): the stages' work counts for the caller's replica.
        self.placement = capture_placement()

    def record(
        self, phase: Literal["forward", "backward"], stage: int, micro: int, edge: Literal["start", "end"]
    ) -> None:
        with self.cond:
            self.events.append(ScheduleEvent(phase, stage, micro, edge))
            recorder = self.recorder
            if recorder is None or not recorder.on:
                return
            now, key = recorder.now(), (phase, stage, micro)
            if edge == "start":
                self.started[key] = now
            elif key in self.started:  # on the stage's own track whichever thread ran it (autograd's, for the last)
                recorder.span(phase, f"{phase} {micro}", self.started.pop(key), now, track=f"stage {stage}",
                              args={"stage": stage, "micro_batch": micro})  # fmt: skip

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()

    def modes(self, device: torch.device) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(apply_placement(self.placement, device=device))
        stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
        for kind, dtype in self.autocast:
            stack.enter_context(torch.autocast(kind, dtype=dtype))
        return stack


class Pipeline:
    """Runs `stages` (modules, one per device) as a GPipe pipeline over `num_micro_batches`.

    Example:
        >>> pipe = Pipeline([nn.Linear(4, 8), nn.Linear(8, 2)], [torch.device("cpu")] * 2,
        ...                 ["cpu:0", "cpu:1"], num_micro_batches=2, timeout=60.0)
        >>> out = pipe.forward(torch.randn(5, 4))        # micro-batches of 3 and 2 examples
        >>> out.sum().backward()                         # returns when both stages are done
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        devices: Sequence[torch.device],
        names: Sequence[str],
        *,
        num_micro_batches: int,
        timeout: float,
        threads_per_stage: int | None = None,
        strategy: Strategy | None = None,
    ) -> None:
        self._stages = list(stages)
        self._devices = list(devices)
        self._names = list(names)
        self.num_micro_batches = num_micro_batches
        self._timeout = timeout
        self._threads_per_stage = threads_per_stage
        self._strategy = strategy
        self._threads: list[_StageThread] | None = None
        self._lock = threading.Lock()
        self.last_run: _Run | None = None
        self.recorder: Recorder | None = None
        """Set by the strategy: each stage's forward and backward of each micro-batch recorded while it is on."""

    @property
    def num_stages(self) -> int:
        return len(self._stages)

    # ---- threads ------------------------------------------------------------------------------
    def _stage_threads(self) -> list[_StageThread]:
        with self._lock:
            if self._threads is None:  # started on first use, and again after close()
                self._threads = [
                    _StageThread(f"stratagem-stage-{s}", functools.partial(self._setup_thread, s))
                    for s in range(self.num_stages)
                ]
            return self._threads

    def _setup_thread(self, stage: int) -> None:
        device = self._devices[stage]
        if device.type == "cpu" and self._threads_per_stage is not None:
            torch.set_num_threads(self._threads_per_stage)
        elif device.type == "cuda":
            torch.cuda.set_device(device)
        enter_replica(ReplicaContext(0, 1, device, self._strategy))

    def close(self) -> None:
        """Stops the stage threads (they start again if the pipeline is used again)."""
        with self._lock:
            threads, self._threads = self._threads, None
        for thread in threads or []:
            thread.stop(self._timeout)

    def _describe(self, stage: int) -> str:
        return f"stage {stage} ({self._names[stage]})"

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Runs the batch `x` through every stage; the output is on the last stage's device."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise InputError(
                "A pipeline cuts its input into micro-batches along the first dimension, so it takes one tensor "
                f"with a batch dimension. Received: {_describe_value(x)}. Pass the batch as one tensor, "
                "e.g. model(x), and combine several inputs inside the first layer."
            )
        num_examples = x.shape[0]
        sizes = split_sizes(num_examples, max(1, min(self.num_micro_batches, num_examples)))
        run = _Run(self.num_stages, sizes, torch.is_grad_enabled(), self.recorder)
        self.last_run = run
        threads = self._stage_threads()
        for m, chunk in enumerate(x.split(sizes)):
            chunk = chunk.to(self._devices[0])
            threads[0].submit(functools.partial(self._forward, run, 0, m, chunk))
        outputs = self._wait_for_outputs(run)
        run.outputs[-1] = [None] * len(sizes)  # the graph holds what backward needs; the run need not
        if not run.grad_enabled or not any(o.requires_grad for o in outputs):
            return torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        return _GatherOutputs.apply(self, run, *outputs)

    def _forward(self, run: _Run, stage: int, micro: int, x: torch.Tensor) -> None:
        if run.error is not None:
            return
        try:
            run.record("forward", stage, micro, "start")
            last = stage == self.num_stages - 1
            with run.modes(self._devices[stage]):
                if stage > 0 and run.grad_enabled and x.is_floating_point():
                    # A leaf of this stage's own graph: its gradient is what the previous stage needs.
                    x = x.requires_grad_()
                    if last:
                        x.register_hook(lambda grad: self._send_grad(run, stage, micro, grad))
                out = self._run_stage(stage, x)
            self._check_output(stage, micro, x, out)
            run.record("forward", stage, micro, "end")
            if last:
                if run.grad_enabled and out.requires_grad:
                    out.register_hook(lambda grad: self._backward_started(run, stage, micro, grad))
                run.outputs[stage][micro] = out
            else:
                if run.grad_enabled:  # kept for this stage's backward
                    run.inputs[stage][micro], run.outputs[stage][micro] = x, out
                moved = out.detach().to(self._devices[stage + 1])
                self._stage_threads()[stage + 1].submit(lambda: self._forward(run, stage + 1, micro, moved))
            with run.cond:
                run.forward_done[stage] += 1
                run.cond.notify_all()
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread, which re-raises it
            _add_note(error, f"(raised in {self._describe(stage)}, forward of micro-batch {micro})")
            run.fail(error)

    def _run_stage(self, stage: int, x: torch.Tensor) -> Any:
        try:
            return self._stages[stage](x)
        except RuntimeError as error:
            if stage == 0 or "leaf Variable that requires grad is being used in an in-place operation" not in str(
                error
            ):
                raise
            first = next(iter(self._stages[stage].named_children()), ("?", None))
            raise InputError(
                f"{self._describe(stage)} changes its input in place, but a stage's input is where the gradient "
                f"is handed back to the previous stage, so it must stay intact. Received: stage {stage} starting at "
                f"layer {first[0]!r} ({type(first[1]).__name__}). Move the split (split_points=) so the stage starts "
                "with a layer that does not work in place, or build that layer with inplace=False."
            ) from error

    def _check_output(self, stage: int, micro: int, x: torch.Tensor, out: Any) -> None:
        if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] != x.shape[0]:
            raise InputError(
                f"{self._describe(stage)} must return one tensor whose first dimension is the micro-batch's "
                f"{x.shape[0]} examples, since the next stage and the output are built from it. Received: "
                f"{_describe_value(out)} for micro-batch {micro}. Keep the batch dimension first in every layer "
                "of a pipeline, and pass one tensor from layer to layer."
            )

    def _wait_for_outputs(self, run: _Run) -> list[torch.Tensor]:
        last = self.num_stages - 1
        deadline = time.monotonic() + self._timeout
        with run.cond:
            while run.error is None and run.forward_done[last] < len(run.sizes):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    stuck = next(s for s in range(self.num_stages) if run.forward_done[s] < len(run.sizes))
                    raise CollectiveTimeoutError(
                        f"Timed out after {self._timeout:g} s waiting for the forward pass: {self._describe(stuck)} "
                        f"finished {run.forward_done[stuck]} of {len(run.sizes)} micro-batches. A layer of that stage "
                        "is stuck or much slower than expected; raise `timeout=` on the strategy if it is "
                        "legitimately this slow."
                    )
                run.cond.wait(remaining)
            if run.error is not None:
                raise run.error
        return [o for o in run.outputs[last] if o is not None]

    # ---- backward -----------------------------------------------------------------------------
    def _backward_started(self, run: _Run, stage: int, micro: int, grad: torch.Tensor) -> None:
        run.record("backward", stage, micro, "start")

    def _send_grad(self, run: _Run, stage: int, micro: int, grad: torch.Tensor | None) -> None:
        """The gradient of `stage`'s input for `micro` is known: the previous stage can start its backward."""
        if stage == self.num_stages - 1:
            run.record("backward", stage, micro, "end")
            run.grad_sent[micro] = True
        if grad is not None:
            grad = grad.to(self._devices[stage - 1])
        self._stage_threads()[stage - 1].submit(lambda: self._backward(run, stage - 1, micro, grad))

    def _backward(self, run: _Run, stage: int, micro: int, grad: torch.Tensor | None) -> None:
        if run.error is not None:
            return
        try:
            out = run.outputs[stage][micro]
            run.outputs[stage][micro] = None  # the graph is freed by this backward; the tensor need not live on
            if grad is not None and out is not None and out.requires_grad:
                run.record("backward", stage, micro, "start")
                with apply_placement(run.placement, device=self._devices[stage]):
                    torch.autograd.backward(out, grad)
                run.record("backward", stage, micro, "end")
            if stage > 0:
                x = run.inputs[stage][micro]
                self._send_grad(run, stage, micro, None if x is None else x.grad)
            run.inputs[stage][micro] = None
            with run.cond:
                run.backward_done[stage] += 1
                run.cond.notify_all()
        except BaseException as error:  # noqa: BLE001 - raised from the caller's loss.backward()
            _add_note(error, f"(raised in {self._describe(stage)}, backward of micro-batch {micro})")
            run.fail(error)

    def finish_backward(self, run: _Run) -> None:
        """Runs when the autograd engine has finished the last stage: waits for the other stages."""
        last = self.num_stages - 1
        if last == 0:
            return
        for micro, sent in enumerate(run.grad_sent):
            if not sent:  # the output does not depend on this micro-batch's input: nothing flows back
                self._send_grad(run, last, micro, None)
        deadline = time.monotonic() + self._timeout
        num_micro = len(run.sizes)
        with run.cond:
            while run.error is None and any(run.backward_done[s] < num_micro for s in range(last)):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    stuck = max(s for s in range(last) if run.backward_done[s] < num_micro)
                    raise CollectiveTimeoutError(
                        f"Timed out after {self._timeout:g} s waiting for the backward pass: {self._describe(stuck)} "
                        f"finished {run.backward_done[stuck]} of {num_micro} micro-batches. A layer of that stage is "
                        "stuck or much slower than expected; raise `timeout=` on the strategy if it is "
                        "legitimately this slow."
                    )
                run.cond.wait(remaining)
            if run.error is not None:
                raise run.error


class _GatherOutputs(torch.autograd.Function):
    """Concatenates the last stage's outputs; its backward makes `loss.backward()` wait for every stage."""

    @staticmethod
    def forward(ctx: Any, pipeline: Pipeline, run: _Run, *outputs: torch.Tensor) -> torch.Tensor:
        ctx.pipeline, ctx.run = pipeline, run
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0].view_as(outputs[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        pipeline, run = ctx.pipeline, ctx.run
        # Runs once this backward pass is over, before loss.backward() returns.
        torch.autograd.Variable._execution_engine.queue_callback(lambda: pipeline.finish_backward(run))
        return (None, None, *grad.split(run.sizes))


def balanced_split_points(param_counts: Sequence[int], num_stages: int) -> list[int]:
    """Where stages 1..S-1 start, for the split that minimises the largest stage's parameter count.

    Among the splits that reach that minimum, one where every stage starts with a layer that has
    parameters is preferred (an activation stays with the layer before it), cutting as late as
    possible when there is still a choice.

    Example:
        >>> balanced_split_points([112, 0, 272, 0, 68], 2)       # Linear, ReLU, Linear, Tanh, Linear
        [2]
    """
    n = len(param_counts)
    prefix = [0]
    for count in param_counts:
        prefix.append(prefix[-1] + count)
    inf = float("inf")
    # best[s][i]: the smallest possible largest stage when the first i layers form s stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            best[s][i] = min(max(best[s - 1][j], prefix[i] - prefix[j]) for j in range(s - 1, i))
    target = best[num_stages][n]

    def bad(j: int) -> int:
        return 1 if param_counts[j] == 0 else 0

    # fewest[s][i]: the fewest stages starting with a parameter-free layer, no stage above target.
    fewest = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    fewest[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            options = [
                fewest[s - 1][j] + (bad(j) if j > 0 else 0) for j in range(s - 1, i) if prefix[i] - prefix[j] <= target
            ]
            fewest[s][i] = min(options, default=inf)
    cuts: list[int] = []
    i = n
    for s in range(num_stages, 1, -1):
        j = max(
            j for j in range(s - 1, i) if prefix[i] - prefix[j] <= target and fewest[s - 1][j] + bad(j) == fewest[s][i]
        )
        cuts.append(j)
        i = j
    return sorted(cuts)


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _add_note(error: BaseException, note: str) -> None:
    if hasattr(error, "add_note") and note not in getattr(error, "__notes__", []):
        error.add_note(note)


class PipelineModel(nn.Module):
    """The layers of the user's `nn.Sequential`, run as a pipeline: same names, same `state_dict()` keys.

    Example:
        >>> model, optimizer = strategy.distribute(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4)), opt)
        >>> out = model(x)              # on the last stage's device
    """

    _pipeline: Pipeline  # set in __init__ as a plain attribute, which nn.Module's __getattr__ does not type

    def __init__(self, layers: nn.Module, pipeline: Pipeline) -> None:
        super().__init__()
        for name, layer in layers.named_children():
            self.add_module(name, layer)
        self.train(layers.training)
        object.__setattr__(self, "_pipeline", pipeline)  # a plain attribute: not a sub-module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._pipeline.forward(x)

    def to(self, *args: Any, **kwargs: Any) -> PipelineModel:
        raise InputError(
            "A model split across devices stays on the devices its strategy chose; it cannot be moved with .to(). "
            f"Received: .to({', '.join(map(repr, args))}). Choose devices with the strategy's stages= instead."
        )
