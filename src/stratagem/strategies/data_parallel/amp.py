"""Mixed precision under a strategy: one loss scale for every replica, and the `precision` setting.

`torch.amp.GradScaler` keeps its bookkeeping per optimizer object ("unscaled", "stepped") and is not
made for several threads calling it at once, as the replicas of one process do. `distribute_scaler`
hands back a `DistributedGradScaler`: one GradScaler per local replica, each called by its own
replica. They stay identical without talking to each other, because each looks for inf/NaN in its
replica's gradients AFTER they were combined across replicas and workers: an inf in any replica is
in every replica's combined gradient, so every replica (and worker) skips the step and lowers its
scale together, as one device would.

Example:
    >>> scaler = strategy.distribute_scaler(torch.amp.GradScaler("cuda"))
    >>> def step(x, y):
    ...     with torch.autocast("cuda", dtype=torch.float16):
    ...         loss = F.cross_entropy(model(x), y)
    ...     scaler.scale(loss).backward()     # gradients combined (still scaled) when it returns
    ...     scaler.step(optimizer)            # skipped on every replica if any replica overflowed
    ...     scaler.update()
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from stratagem.errors import InputError
from stratagem.strategies.data_parallel.distributed import ReplicatedOptimizer
from stratagem.strategies.data_parallel.host import ReplicaHost
from stratagem.strategies.distribute_checks import check_scaler
from stratagem.strategies.replica_context import current_replica_context

PRECISIONS = ("32", "bf16", "fp16")


class _ReplicaGradients:
    """What a replica's scaler sees of the distributed optimizer: the replica's own parameters, which hold
    its combined gradients (a sharded or central optimizer's `param_groups` hold other tensors), and the
    distributed optimizer's `step()`."""

    _step_supports_amp_scaling = False

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
        self._optimizer = optimizer
        self.param_groups = [{"params": params}]

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.step(*args, **kwargs)


class DistributedGradScaler:
    """One `torch.amp.GradScaler` per local replica; calls go to the running replica's (replica 0's outside `run`)."""

    def __init__(self, scalers: Sequence[torch.amp.GradScaler], host: ReplicaHost) -> None:
        self._scalers = list(scalers)
        self._host = host
        self._views: dict[tuple[int, int], _ReplicaGradients] = {}

    def _replica(self) -> int:
        replica = self._host.current_replica()
        return 0 if replica is None else replica

    def _view(self, optimizer: torch.optim.Optimizer) -> Any:
        """The running replica's `_ReplicaGradients` of `optimizer` (one object per replica and optimizer, since
        torch's scaler keeps its per-step bookkeeping by the optimizer's id)."""
        replica = self._replica()
        key = (replica, id(optimizer))
        view = self._views.get(key)
        if view is None:
            if not isinstance(optimizer, ReplicatedOptimizer):
                return optimizer  # a plain optimizer: its own parameters hold the gradients
            indices = optimizer.updated_parameter_indices()
            params = self._host.replica_params[replica]
            view = self._views[key] = _ReplicaGradients(optimizer, [params[i] for i in indices])
        return view

    @property
    def scaler(self) -> torch.amp.GradScaler:
        """The running replica's scaler."""
        return self._scalers[self._replica()]

    @property
    def scalers(self) -> list[torch.amp.GradScaler]:
        """Every local replica's scaler, in replica order."""
        return list(self._scalers)

    def scale(self, outputs: Any) -> Any:
        return self.scaler.scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(self._view(optimizer))

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        return self.scaler.step(self._view(optimizer), *args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if current_replica_context() is None:
            for scaler in self._scalers:  # outside run: a scale set by hand goes to every replica
                scaler.update(new_scale)
            return
        self.scaler.update(new_scale)

    def get_scale(self) -> float:
        return self.scaler.get_scale()

    def is_enabled(self) -> bool:
        return self.scaler.is_enabled()

    def state_dict(self) -> dict[str, Any]:
        return self._scalers[0].state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for scaler in self._scalers:
            scaler.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"DistributedGradScaler(num_replicas={len(self._scalers)}, scale={self._scalers[0].get_scale()})"


def replicate_scaler(scaler: Any, host: ReplicaHost | None) -> Any:
    """`scaler` itself where one thread runs the step (no host, or one local replica), else a
    `DistributedGradScaler` of one copy per local replica of `host`."""
    check_scaler(scaler)
    if host is None or host.num_local_replicas == 1:
        return scaler  # one thread calls it: torch's scaler works as it is
    copies = [copy.deepcopy(scaler) for _ in range(host.num_local_replicas - 1)]
    return DistributedGradScaler([scaler, *copies], host)


_SHARED_SCALER_SYMPTOMS = (
    "has already been called on this optimizer since the last update",
    "step() has already been called since the last update",
    "No inf checks were recorded for this optimizer",
)


def shared_scaler_error(error: BaseException) -> InputError | None:
    """What torch's GradScaler raises when several replica threads share it, said plainly; None otherwise."""
    if not isinstance(error, (RuntimeError, AssertionError)) or not any(
        s in str(error) for s in _SHARED_SCALER_SYMPTOMS
    ):
        return None
    return InputError(
        "A torch.amp.GradScaler was called by several replicas of this process at once; it keeps one record per "
        f"optimizer and step, so it cannot serve them. Received: {type(error).__name__}: {error} Wrap it once, "
        "outside the step function: scaler = strategy.distribute_scaler(torch.amp.GradScaler(...))."
    )


def check_precision(precision: Any, device_types: Sequence[str]) -> str:
    """Validates a precision setting ("32", "bf16", "fp16") for replicas on `device_types`; returns it."""
    text = str(precision)
    if text not in PRECISIONS:
        raise InputError(
            f"Unknown precision. Received: precision={precision!r}. Use one of {', '.join(map(repr, PRECISIONS))}."
        )
    if text == "fp16" and any(kind != "cuda" for kind in device_types):
        raise InputError(
            "precision='fp16' needs loss scaling (torch.amp.GradScaler), which stratagem supports on CUDA GPUs "
            f"only, and float16 autocast on the CPU is slow and unsafe without it. Received: precision='fp16' with "
            f"replicas on {', '.join(sorted(set(device_types)))}. Use precision='bf16' on the CPU (no loss scaling "
            "needed), or run on GPUs."
        )
    return text


@contextlib.contextmanager
def precision_autocast(precision: str, device_type: str) -> Iterator[None]:
    """The autocast a precision setting means on `device_type` (nothing for "32")."""
    if precision == "32":
        yield
        return
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    with torch.autocast(device_type, dtype=dtype):
        yield
