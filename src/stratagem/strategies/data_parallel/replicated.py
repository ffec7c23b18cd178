"""What the data-parallel strategies share: a `ReplicaSet` each holds, and the members their parts call.

Mirrored, OneDevice, CentralStorage and MultiWorkerMirrored subclass `ReplicatedStrategy` and only
build their `ReplicaSet` from parts (see each class's parts list); the `Strategy` members are
delegated to that set here, once. What runs inside the replicas (the distributed model and optimizer,
the loss scaler, `sg.set_loss_weight`) calls the set itself, through the protocol it declares
(`host.ReplicaHost`). No strategy subclasses another one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from stratagem.errors import InputError
from stratagem.strategies import lr_schedulers
from stratagem.strategies.base import Strategy
from stratagem.strategies.data_parallel import cuda_numerics
from stratagem.strategies.data_parallel.amp import replicate_scaler
from stratagem.strategies.data_parallel.distributed import ReplicatedOptimizer
from stratagem.strategies.data_parallel.replica_set import ReplicaSet
from stratagem.strategies.explain import Explanation, ReplicaPlacement
from stratagem.timeouts import check_seconds


def check_timeout(timeout: float) -> float:
    """The replicas' timeout in seconds (`stratagem.timeouts.check_seconds`)."""
    return check_seconds("timeout", timeout)


def _adjusts(scheduler: Any, optimizer: Any) -> bool:
    """Whether `scheduler` was built on `optimizer`, as `distribute` returned it or as the user gave it."""
    target = getattr(scheduler, "optimizer", None)
    if target is optimizer:
        return True
    return isinstance(optimizer, ReplicatedOptimizer) and target is optimizer.primary_optimizer


class ReplicatedStrategy(Strategy):
    """A strategy made of one `ReplicaSet` (`_replicas`, built by the subclass's constructor from its parts)."""

    _replicas: ReplicaSet

    @property
    def local_devices(self) -> list[torch.device]:
        return list(self._replicas.devices)

    @property
    def num_replicas_in_sync(self) -> int:
        return self._replicas.num_replicas_in_sync

    @property
    def distributed_model(self) -> nn.Module | None:
        return self._replicas.model

    def distribute(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Places a replica of `model` on every device (see the class's parts); returns `(model, optimizer)`,
        or the model alone when no optimizer is given. The model returned is a `DistributedModel` under every
        replica count, whose `.module` is the plain model (the running replica's copy inside `run`).

        Called once per model: a step may use several (a GAN's generator and discriminator with an optimizer
        each, a frozen teacher distributed without one), and every backward pass combines the gradients of
        every model it reached, exactly as on one device.

        Example:
            >>> g, opt_g = strategy.distribute(Generator(), torch.optim.Adam(g_params))
            >>> d, opt_d = strategy.distribute(Discriminator(), torch.optim.Adam(d_params))
        """
        self._check_distribute_args(model, optimizer, None)  # several models: ReplicaSet checks they share nothing
        return self._replicas.distribute(model, optimizer)

    def distribute_scheduler(self, scheduler: Any) -> lr_schedulers.DistributedScheduler:
        """`scheduler` stepped once per global step, whether its `step()` is called in the step function (by
        every replica) or after `run`; see `Strategy.distribute_scheduler`."""
        # The optimizer the scheduler adjusts, among those of every distributed model (the first one by default).
        optimizers = [o for o in self._replicas.optimizers if o is not None]
        optimizer = next((o for o in optimizers if _adjusts(scheduler, o)), self._replicas.optimizer)
        if optimizer is None:
            raise InputError(
                "distribute_scheduler() needs the optimizer distributed first. Received: a "
                f"{type(scheduler).__name__} before strategy.distribute(model, optimizer). Call distribute first."
            )
        host = optimizer if isinstance(optimizer, ReplicatedOptimizer) else None
        return lr_schedulers.distribute_scheduler(scheduler, host, optimizer)

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """Runs `fn` once per replica, in parallel, each with its slice of the distributed inputs.

        Returns the per-replica results (`PerReplica` leaves; the plain result with one replica).
        An exception in any replica stops the others and is re-raised here.
        """
        return self._replicas.run(fn, args, kwargs)

    def distribute_scaler(self, scaler: torch.amp.GradScaler) -> Any:
        """A loss scaler for this strategy's step function: `scaler` itself with one local replica, else one
        scaler per local replica behind one object (see `stratagem.strategies.data_parallel.amp`).

        Example:
            >>> scaler = strategy.distribute_scaler(torch.amp.GradScaler("cuda"))
        """
        return replicate_scaler(scaler, self._replicas)

    def no_sync(self) -> Any:
        """A context in which backward only accumulates each replica's gradients, as DDP's `no_sync`.

        Gradient accumulation over K micro-batches combines once instead of K times: run the first
        K-1 micro-batches inside it and the last one outside; that last backward combines everything
        accumulated, each micro-batch weighted by each replica's share of it, so the result is one
        device's sum of the K gradients. `optimizer.step()` before that last backward is refused.
        Where every backward pass combines anyway (one replica, central storage) it changes nothing.

        Example:
            >>> for i, batch in enumerate(strategy.distribute_dataset(loader)):
            ...     last = i % k == k - 1
            ...     with contextlib.nullcontext() if last else strategy.no_sync():
            ...         strategy.run(micro_step, args=(batch, last))  # steps the optimizer when last
        """
        return self._replicas.no_sync()

    def explain(self) -> Explanation:
        """Where the replicas run and why: the decisions of every part, in the order a step meets them."""
        replica_set = self._replicas
        replicas = [
            ReplicaPlacement(r, name, str(device))
            for r, (name, device) in enumerate(zip(replica_set.names, replica_set.devices))
        ]
        parts = self._parts()
        decisions = [decision for part in parts for decision in part.decisions()]
        tf32 = cuda_numerics.tf32_decision(replica_set.devices)  # read now: the switches are the user's to flip
        if tf32 is not None:
            decisions.append(tf32)
        details: dict[str, Any] = {}
        for part in parts:
            details.update(part.details())
        return Explanation(type(self).__name__, self.num_replicas_in_sync, replicas, decisions, details)

    def _parts(self) -> tuple[Any, ...]:
        """Every part of this strategy, in the order a step meets them (the replica set's, and any of its own)."""
        return self._replicas.parts

    def close(self) -> None:
        """Stops the replica threads (they also stop when the process exits); BatchNorm layers get their own
        forward back."""
        self._replicas.close()
