"""Will the model fit? A lower bound on training memory per replica, checked against free memory.

The estimate counts what every data-parallel replica holds for certain: parameters, their
gradients and the optimizer's state. Activations depend on the batch and the model's graph and
are not counted, so a model that fails this check surely does not fit, and one that passes may
still not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from stratagem.diagnose.facts import EnvironmentFacts, GpuFacts
from stratagem.diagnose.verdict import Check
from stratagem.errors import MemoryEstimateError, MemoryEstimateInputError


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes one replica needs before any activation is stored.

    Example:
        >>> estimate_training_memory(1000, "adam").total_bytes
        4000
    """

    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    optimizer: str
    """The optimizer's name and the state it keeps, e.g. ``"Adam (2x parameters)"``."""

    @property
    def total_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes

    def describe(self) -> str:
        return (
            f"{format_bytes(self.total_bytes)} (parameters {format_bytes(self.parameter_bytes)} + "
            f"gradients {format_bytes(self.gradient_bytes)} + {self.optimizer} state "
            f"{format_bytes(self.optimizer_state_bytes)}; activations not counted)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total_bytes": self.total_bytes}


def estimate_training_memory(
    model_or_param_bytes: torch.nn.Module | int, optimizer: torch.optim.Optimizer | str | None
) -> MemoryEstimate:
    """Parameters + gradients + optimizer state, in bytes, for one replica.

    The optimizer's state per parameter: plain SGD none, SGD with momentum 1x, Adam and AdamW 2x
    (3x with ``amsgrad``), RMSprop 1x (+1x with momentum, +1x centered), Adagrad 1x. Pass the
    optimizer itself, or its name for the defaults.

    Example:
        >>> model = torch.nn.Linear(1024, 1024)        # 1,049,600 float32 parameters
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> estimate_training_memory(model, opt).total_bytes == 4 * 4 * 1_049_600
        True

    Raises:
        MemoryEstimateInputError: the optimizer's state size is not known.
    """
    if isinstance(model_or_param_bytes, torch.nn.Module):
        params = list(model_or_param_bytes.parameters())
        parameter_bytes = sum(p.numel() * p.element_size() for p in params)
        trainable_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    elif isinstance(model_or_param_bytes, int) and model_or_param_bytes >= 0:
        parameter_bytes = trainable_bytes = model_or_param_bytes
    else:
        raise MemoryEstimateInputError(
            f"estimate_training_memory needs a torch.nn.Module or a byte count >= 0. "
            f"Received: model_or_param_bytes={model_or_param_bytes!r}. Pass the model, or the bytes "
            "of its parameters as an int."
        )
    name, factor = _state_factor(optimizer)
    return MemoryEstimate(
        parameter_bytes=parameter_bytes,
        gradient_bytes=trainable_bytes,
        optimizer_state_bytes=factor * trainable_bytes,
        optimizer=f"{name} ({factor}x parameters)",
    )


def check_memory(facts: EnvironmentFacts, estimate: MemoryEstimate, devices: Sequence[int] | None = None) -> Check:
    """Compares the estimate to each GPU's free memory (all GPUs unless ``devices`` names some)."""
    gpus = [gpu for gpu in facts.gpus if devices is None or gpu.index in devices]
    known = [gpu for gpu in gpus if gpu.free_memory is not None]
    if not known:
        return Check(name="memory", verdict="ok", reason="Not checked: no GPU with known free memory.")
    short = [gpu for gpu in known if _free(gpu) < estimate.total_bytes]
    if not short:
        least = min(known, key=_free)
        return Check(
            name="memory",
            verdict="ok",
            reason=(
                f"Training needs at least {estimate.describe()} per replica; the GPU with "
                f"the least free memory, cuda:{least.index}, has {format_bytes(_free(least))}."
            ),
        )
    lacking = ", ".join(
        f"cuda:{gpu.index} has {format_bytes(_free(gpu))} free of {format_bytes(gpu.total_memory)}" for gpu in short
    )
    roomy = [f"cuda:{gpu.index}" for gpu in known if gpu not in short]
    fewer = (
        f"use fewer replicas, on the GPUs with room (devices={roomy})"
        if roomy
        else "free memory held by other processes (nvidia-smi lists them)"
    )
    return Check(
        name="memory",
        verdict="problem",
        reason=f"Training needs at least {estimate.describe()} per replica, but {lacking}.",
        fix=(
            f"Either {fewer}; or CentralStorageStrategy, which keeps the parameters and optimizer "
            "state on the CPU; or model parallelism, which splits the model across GPUs; or an "
            "optimizer with less state (SGD keeps none)."
        ),
    )


def _free(gpu: GpuFacts) -> int:
    """The free memory of a GPU of `check_memory`'s `known` list (those whose free memory was read)."""
    assert gpu.free_memory is not None
    return gpu.free_memory


def ensure_fits(facts: EnvironmentFacts, estimate: MemoryEstimate, devices: Sequence[int] | None = None) -> None:
    """Raises `MemoryEstimateError` with both numbers when `check_memory` finds a problem."""
    check = check_memory(facts, estimate, devices)
    if check.verdict == "problem":
        raise MemoryEstimateError(check.message)


def format_bytes(count: int) -> str:
    """``1536`` -> ``"1.50 KiB"``; binary units, as nvidia-smi's MiB."""
    if count < 1024:
        return f"{count} B"
    value = count / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"


def _state_factor(optimizer: torch.optim.Optimizer | str | None) -> tuple[str, int]:
    if optimizer is None:
        return "no optimizer", 0
    if isinstance(optimizer, str):
        key = optimizer.lower()
        defaults = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2, "rmsprop": 1, "adagrad": 1}
        if key not in defaults:
            raise MemoryEstimateInputError(
                f"The memory estimate does not know optimizer {optimizer!r}. Received: optimizer={optimizer!r}. "
                f"Use one of {sorted(defaults)}, or pass the optimizer object."
            )
        return optimizer, defaults[key]
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.SGD):
        return name, 1 if group.get("momentum", 0) else 0
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return name, 3 if group.get("amsgrad", False) else 2
    if isinstance(optimizer, torch.optim.RMSprop):
        return name, 1 + (1 if group.get("momentum", 0) else 0) + (1 if group.get("centered", False) else 0)
    if isinstance(optimizer, torch.optim.Adagrad):
        return name, 1
    raise MemoryEstimateInputError(
        f"The memory estimate does not know the state size of {name}. Received: optimizer={name}. "
        "Use SGD, Adam, AdamW, RMSprop or Adagrad, or pass the bytes yourself: "
        "estimate_training_memory(param_bytes, 'adam') for an optimizer with Adam's 2x state."
    )
