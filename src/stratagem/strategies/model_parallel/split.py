"""How ModelParallelStrategy cuts a model into per-device groups, and moves tensors between them.

Two ways, matching the strategy's two arguments:

- `split_sequential`: the layers of an `nn.Sequential` cut into consecutive stages (at the given
  split points, or balanced by parameter count), one per device, for the pipeline;
- `group_placement` and `place_modules`: named modules of any model on their devices; a
  parameter goes with the longest placed prefix of its module's name, and forward hooks move a
  placed module's inputs to its device and its outputs back to its caller's.

Both refuse a parameter that would live on two devices (tied weights across a cut).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from stratagem import devices as sg_devices
from stratagem.diagnose import PlacementDecision
from stratagem.errors import InputError
from stratagem.strategies.model_parallel.pipeline import balanced_split_points
from stratagem.values import map_structure

Group = tuple[sg_devices.LogicalDevice, list[str], list[nn.Parameter]]
"""A stage: its device, the names of its modules, its parameters."""

ROOT = ""
"""The placement key of the model itself (where code not in a placed module runs)."""


def split_sequential(
    model: nn.Module,
    devices: Sequence[sg_devices.LogicalDevice],
    split_points: list[int] | None,
    num_micro_batches: int,
) -> tuple[list[Group], PlacementDecision]:
    """The stages of ``model`` (an `nn.Sequential`) on ``devices``, and the decision that says where it was cut.

    Raises:
        InputError: not an `nn.Sequential`, fewer layers than stages, BatchNorm with micro-batches,
            split points past the last layer, or a parameter shared across a cut.
    """
    num_stages = len(devices)
    if not isinstance(model, nn.Sequential):
        raise InputError(
            f"stages= cuts the layers of an nn.Sequential into consecutive stages. Received: a "
            f"{type(model).__name__}. Write the model as an nn.Sequential of its layers, or use "
            "placement={'module name': 'device', ...}, which places named modules of any model."
        )
    layers = list(model.named_children())
    if len(layers) < num_stages:
        raise InputError(
            f"{num_stages} stages need at least {num_stages} layers to cut. Received: an nn.Sequential of "
            f"{len(layers)} layer(s) and stages={[d.name for d in devices]}. Use fewer stages."
        )
    if num_micro_batches > 1:
        norms = [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if norms:
            raise InputError(
                f"BatchNorm layers {norms} would normalise each micro-batch with its own statistics, so training "
                f"would differ from one device on the whole batch. Received: num_micro_batches="
                f"{num_micro_batches}. Use num_micro_batches=1 (exact), or a per-example normalisation "
                "(nn.GroupNorm, nn.LayerNorm)."
            )
    counts = [sum(p.numel() for p in layer.parameters()) for _, layer in layers]
    if split_points is not None:
        points, why = split_points, f"given by split_points={split_points}"
        if points[-1] >= len(layers):
            raise InputError(
                f"split_points must be layer indices between 1 and {len(layers) - 1} for this nn.Sequential of "
                f"{len(layers)} layers. Received: split_points={points}. Every stage needs at least one layer."
            )
    else:
        points = balanced_split_points(counts, num_stages)
        why = (
            "balanced by parameter count (the largest stage as small as possible; an activation stays "
            "with the layer before it); set split_points= to choose"
        )
    bounds = [0, *points, len(layers)]
    stage_counts = [sum(counts[a:b]) for a, b in itertools.pairwise(bounds)]
    decision = PlacementDecision(
        subject="split",
        choice=f"stages start at layers {bounds[:-1]}",
        reason=f"{why}; parameters per stage {stage_counts}",
    )
    groups = []
    for device, (a, b) in zip(devices, itertools.pairwise(bounds)):
        names = [name for name, _ in layers[a:b]]
        params = _unique([p for _, layer in layers[a:b] for p in layer.parameters()])
        groups.append((device, names, params))
    _check_not_shared(groups)
    return groups, decision


def group_placement(model: nn.Module, placement: dict[str, sg_devices.LogicalDevice]) -> list[Group]:
    """Which parameters each device holds: a parameter goes with the longest placed prefix of its module.

    Raises:
        InputError: ``placement`` names a module the model does not have, or a parameter is shared
            by modules on two devices.
    """
    modules = dict(model.named_modules())
    unknown = [name for name in placement if name not in modules]
    if unknown:
        valid = [name for name in modules if name]
        shown = ", ".join(map(repr, valid[:40])) + (f", ... ({len(valid)} in all)" if len(valid) > 40 else "")
        raise InputError(
            f"placement names modules that this {type(model).__name__} does not have: {unknown}. Valid names "
            f"(as in model.named_modules()): {shown}; '' is the model itself."
        )
    by_device: dict[str, tuple[sg_devices.LogicalDevice, list[str], list[nn.Parameter]]] = {}
    for name, device in placement.items():
        by_device.setdefault(device.name, (device, [], []))[1].append(name)
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = _owner(name.rpartition(".")[0], placement)
        by_device[placement[owner].name][2].append(param)
    groups = [(d, names, _unique(params)) for d, names, params in by_device.values()]
    _check_not_shared(groups)
    return groups


def place_modules(model: nn.Module, placement: dict[str, sg_devices.LogicalDevice]) -> list[Any]:
    """Moves each placed module of ``model`` to its device; returns the handles of the hooks that move tensors."""
    modules = dict(model.named_modules())
    # Shallow first, so that a module placed inside another placed module ends up on its own device.
    for name in sorted(placement, key=lambda n: (n.count(".") + bool(n), n)):
        modules[name].to(placement[name].physical)
    hooks = []
    for name, device in placement.items():
        parent = placement[_owner(name.rpartition(".")[0], placement)]
        if name == ROOT or parent.name == device.name:
            continue
        module = modules[name]
        hooks.append(module.register_forward_pre_hook(_move_inputs(device.physical), with_kwargs=True))
        hooks.append(module.register_forward_hook(_move_outputs(parent.physical)))
    return hooks


def _owner(module_name: str, placement: Mapping[str, Any]) -> str:
    """The placed module whose device `module_name` runs on: the longest placed prefix ("" at worst)."""
    best = ROOT
    for name in placement:
        if name and (module_name == name or module_name.startswith(name + ".")) and len(name) > len(best):
            best = name
    return best


def _move_inputs(device: torch.device) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _to(args, device), _to(kwargs, device)

    return hook


def _move_outputs(device: torch.device) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        return _to(output, device)

    return hook


def _to(structure: Any, device: torch.device) -> Any:
    return map_structure(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, structure)


def _unique(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return list({id(p): p for p in params}.values())


def _check_not_shared(groups: Sequence[Group]) -> None:
    """A parameter used by modules on two devices can live on only one of them: refuse the split."""
    seen: dict[int, str] = {}
    for device, names, params in groups:
        for p in params:
            other = seen.setdefault(id(p), device.name)
            if other != device.name:
                raise InputError(
                    f"A parameter of shape {tuple(p.shape)} is shared by modules on {other} and {device.name} (tied "
                    f"weights), but it can live on one device only. Received: modules {names} on {device.name}. Put "
                    "the modules that share it on the same device."
                )
