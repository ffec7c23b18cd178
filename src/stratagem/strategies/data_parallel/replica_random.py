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
own generator, seeded per replica). The cost is one Python call per operator on replicas 1..N-1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, ContextManager

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from stratagem.diagnose import PlacementDecision
from stratagem.strategies.data_parallel.cuda_numerics import replica_seed
from stratagem.strategies.data_parallel.step_part import Built, StepPart

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

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        target = _target(func)
        if target is not None and kwargs.get(target[1]) is None and _on_cpu(args, kwargs):
            op, name = target
            position = [a.name for a in op._schema.arguments].index(name)
            if position >= len(args):
                return op(*args, **{**kwargs, name: self.generator})
            if args[position] is None:
                return op(*args[:position], self.generator, *args[position + 1 :], **kwargs)
        return func(*args, **kwargs)


class ReplicaRandomPart(StepPart):
    """The step part that gives each CPU replica but the first its own generator (see the module docstring)."""

    def __init__(self, devices: Sequence[torch.device], first_global_replica: Callable[[], int]) -> None:
        self._devices = list(devices)
        self._first_global_replica = first_global_replica
        self._modes: list[ReplicaRandom | None] = [None] * len(self._devices)

    def prepare(self, built: Built, replica_params: list[list[nn.Parameter]]) -> None:
        """Seeds the generators from torch's base seed now (`torch.manual_seed` before `distribute`)."""
        base, first = torch.initial_seed(), self._first_global_replica()
        self._modes = [
            ReplicaRandom(torch.Generator().manual_seed(replica_seed(base, first + r)))
            if r > 0 and device.type == "cpu"
            else None
            for r, device in enumerate(self._devices)
        ]

    def random(self, replica: int) -> ContextManager[Any]:
        """Where replica `replica`'s step runs: under its generator's mode, or as it is (replica 0, GPUs)."""
        mode = self._modes[replica]
        return mode if mode is not None else contextlib.nullcontext()

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
                    "distribute()"
                ),
            )
        ]
