"""The checks of what a strategy's `distribute`, `distribute_scaler` and friends are handed, before anything is
copied: shared by every strategy (`base.Strategy` calls them), so they live below the strategy folders."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stratagem.errors import InputError


def check_optimizer_matches(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raises `InputError` when the optimizer holds a tensor that is not a parameter of the model."""
    own = {id(p) for p in model.parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in own:
                raise InputError(
                    "The optimizer holds a tensor that is not a parameter of the model given to distribute(). "
                    f"Received: a tensor of shape {tuple(p.shape)} in param_groups[{g}]. Build the optimizer from "
                    "model.parameters() of the same model object you distribute."
                )


def check_scaler(scaler: Any) -> None:
    """Raises `InputError` when `scaler` is not a `torch.amp.GradScaler` (what `distribute_scaler` takes)."""
    if not isinstance(scaler, torch.amp.GradScaler):
        raise InputError(
            f"distribute_scaler() takes a torch.amp.GradScaler. Received: {type(scaler).__name__}. "
            "Build one with torch.amp.GradScaler('cuda') (or 'cpu')."
        )
