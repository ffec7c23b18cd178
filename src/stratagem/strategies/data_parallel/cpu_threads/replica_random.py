"""Each CPU replica draws its random numbers from its own generator (`ReplicaRandom`), so dropout repeats.

On a CPU, torch has one default generator per process and no per-thread one: replicas on logical CPU
devices are threads of one process, so dropout masks drawn from that generator would depend on the order in
which the threads happen to run, and two runs with one seed would differ. `torch.random.fork_rng` does not
help (it saves and restores the process-wide state), and serialising every region that draws would run the
replicas' forward passes one after another.

So each CPU replica but replica 0 runs its step under a `TorchDispatchMode` (torch keeps the mode stack per
thread) that hands a random operator without an explicit generator the replica's own `torch.Generator`:
every ATen operator that draws takes a `generator` argument (`bernoulli_`, `normal_`, `uniform_`,
`multinomial`, ...; `rand`, `randn`, `randint`, `randperm` through their `.generator` overloads), and CPU
dropout is `bernoulli_` underneath. Replica r's generator is seeded at `distribute` with
`torch.initial_seed() + r x 0x9E3779B97F4A7C15` (r its global index, as GPU replicas' streams in
cuda_numerics.py) and keeps its state from step to step; replica 0 keeps torch's own generator, so one replica
is plain torch. A generator the user passes is left alone; so are operators on GPU tensors (each GPU has its
own generator, seeded per replica). The cost is one Python call per operator on replicas 1..N-1, so the
mode is on only where the step draws (see `ReplicaRandomPart`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, ContextManager

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from stratagem.diagnose import PlacementDecision
from stratagem.strategies.data_parallel.cpu_threads.hand_updates import run_keeping_versions
from stratagem.strategies.data_parallel.cuda_numerics import replica_seed
from stratagem.strategies.data_parallel.step_part import Built, RunState, StepPart

logger = logging.getLogger(__name__)

_NO_GENERATOR: tuple[Any, str] | None = None
_targets: dict[Any, tuple[Any, str] | None] = {}


def _target(func: Any) -> tuple[Any, str] | None:
    """The overload of `func` that takes a generator, and the argument's name; None for an operator that does
    not draw."""
    if func in _targets:
        return _targets[func]
    found: tuple[Any, str] | None = _NO_GENERATOR
    schema = func._schema
    for argument in schema.arguments:
        if "Generator" in str(argument.type):
            found = (func, argument.name)
            break
    if found is None and not schema.is_mutable:
        names = {a.name for a in schema.arguments}
        packet = func.overloadpacket
        for overload in packet.overloads():
            other = getattr(packet, overload)
            other_names = {a.name for a in other._schema.arguments}
            if other_names == names | {"generator"} and "out" not in other_names:
                found = (other, "generator")
                break
    _targets[func] = found
    return found


def _on_cpu(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type == "cpu"
    device = kwargs.get("device")
    return device is None or torch.device(device).type == "cpu"


class ReplicaRandom(TorchDispatchMode):
    """Inside it, random operators on CPU tensors without a generator draw from `generator`."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator = generator
        self.draws = 0  # random operators seen (on this replica's thread only)

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        target = _target(func)
        if target is not None and kwargs.get(target[1]) is None and _on_cpu(args, kwargs):
            op, name = target
            self.draws += 1
            position = [a.name for a in op._schema.arguments].index(name)
            if position >= len(args):
                return op(*args, **{**kwargs, name: self.generator})
            if args[position] is None:
                return op(*args[:position], self.generator, *args[position + 1 :], **kwargs)
        return run_keeping_versions(func, args, kwargs)


_DRAWING_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def draws_in_forward(model: nn.Module) -> bool:
    """Whether `model` holds a layer that draws random numbers in training (dropout with p > 0, RReLU)."""
    return any(isinstance(m, nn.RReLU) or (isinstance(m, _DRAWING_MODULES) and m.p > 0) for m in model.modules())


class ReplicaRandomPart(StepPart):
    """The step part that gives each CPU replica but the first its own generator (see the module docstring).

    The mode costs one Python call per operator (and a profiler sees each operator twice under it), so it is on
    only where something draws: from the first step for a model with dropout or RReLU; otherwise from the step
    after one in which torch's own generator is seen to have moved (logged: that step drew in thread order).
    A model that draws nothing runs its steps exactly as without stratagem's modes (tests/test_placement_log.py)."""

    def __init__(self, devices: Sequence[torch.device], first_global_replica: Callable[[], int]) -> None:
        self._devices = list(devices)
        self._first_global_replica = first_global_replica
        self._modes: list[ReplicaRandom | None] = [None] * len(self._devices)
        self._on = False
        self._always = False
        self._before: torch.Tensor | None = None

    def prepare(self, built: Built, replica_params: list[list[nn.Parameter]]) -> None:
        """Seeds the generators from torch's base seed now (`torch.manual_seed` before `distribute`)."""
        base, first = torch.initial_seed(), self._first_global_replica()
        self._modes = [
            ReplicaRandom(torch.Generator().manual_seed(replica_seed(base, first + r)))
            if r > 0 and device.type == "cpu"
            else None
            for r, device in enumerate(self._devices)
        ]
        self._always = draws_in_forward(built.replicas[0])
        self._on = self._always

    def begin_step(self, state: RunState) -> None:
        if not self._on and self._active:
            self._before = torch.random.get_rng_state()

    def end_run(self, state: RunState) -> None:
        if not self._active:
            return
        if not self._on and self._before is not None and not torch.equal(self._before, torch.random.get_rng_state()):
            self._on = True
            logger.warning(
                "Step %d drew random numbers from torch's CPU generator on several CPU replicas, in the order their "
                "threads ran, so it may differ from run to run; from the next step each replica draws from its own "
                "generator. A model whose layers draw (dropout, RReLU) gets its own generators from the first step.",
                state.step,
            )
        self._before = None

    @property
    def _active(self) -> bool:
        return any(mode is not None for mode in self._modes)

    def random(self, replica: int) -> ContextManager[Any]:
        """Where replica `replica`'s step runs: under its generator's mode, or as it is (replica 0, GPUs)."""
        mode = self._modes[replica]
        return mode if mode is not None and self._on else contextlib.nullcontext()

    def decisions(self) -> list[PlacementDecision]:
        if not any(mode is not None for mode in self._modes):
            return []
        return [
            PlacementDecision(
                subject="CPU random streams",
                choice="one per replica",
                reason=(
                    "the CPU replicas are threads sharing torch's one CPU generator, so each replica but the first "
                    "draws from its own, seeded with the base seed + replica x 0x9E3779B97F4A7C15 at distribute() "
                    "(replica 0 keeps torch's): dropout repeats from run to run; call torch.manual_seed before "
                    "distribute(). On from the first step for a model with dropout or RReLU; else from the step "
                    "after one seen to draw"
                ),
            )
        ]
