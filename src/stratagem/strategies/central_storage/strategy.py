"""CentralStorageStrategy: the parameters and the optimizer state live once, on one device, while
every local device computes (tf.distribute.experimental.CentralStorageStrategy).

Each step:

1. every replica that does not read the central parameters in place receives a copy of them (on
   GPUs that copy is the strategy's cost, paid every step; replicas on the central device share
   its storage and pay nothing);
2. each replica runs the step function on its slice of the global batch, on its own device;
3. when `backward()` finishes, the replicas' gradients, each weighted by the replica's share of the
   global batch, are summed on the central device and the sum is handed back to every replica, so
   clipping and gradient logging in the step function see the gradient of the whole global batch;
4. `optimizer.step()`, called by every replica, applies the user's own optimizer once, on the
   central device, after every replica has reached it; its state therefore exists once.

The gradient weighting, the replica threads and the barriers are the replica set's
(strategies/data_parallel/replica_set.py), as under MirroredStrategy; the central copy, its update and the
reduction onto it are the `CentralUpdate` part (strategies/central_storage/update.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from stratagem import devices as sg_devices
from stratagem import diagnose, environ
from stratagem.errors import DeviceError, GpuUnavailableError, InputError
from stratagem.strategies.central_storage.update import CentralUpdate
from stratagem.strategies.data_parallel.batch_norm import check_batch_norm_mode
from stratagem.strategies.data_parallel.placement import place_replicas
from stratagem.strategies.data_parallel.replica_set import ReplicaSet
from stratagem.strategies.data_parallel.replicated import ReplicatedStrategy, check_timeout

logger = logging.getLogger(__name__)


class CentralStorageStrategy(ReplicatedStrategy):
    """Parameters and optimizer state once on a central device, computation replicated on every
    local device (tf.distribute.experimental.CentralStorageStrategy).

    Args:
        devices: the compute devices, in TF or torch spelling (`["/gpu:0", "cuda:1"]`,
            `["cpu:0", "cpu:1"]`). None: every visible GPU, or the CPU when there is none.
        parameter_device: where the parameters and the optimizer state live (`"cpu"`, `"cuda:0"`).
            None: the compute device when there is exactly one (the only GPU, say), else the CPU.
        share_parameters: replicas on the central device read its parameters in place (no copy).
            False gives every replica its own copy, refreshed at the start of every step.
        require_gpu: raise `GpuUnavailableError`, with the diagnosis, instead of computing on the CPU.
        timeout: seconds any replica waits for the others before failing with an error naming them.
        intra_op_threads: torch intra-op threads per CPU replica (default: shared evenly).
        batch_norm: "global" (default) or "per_replica", as for MirroredStrategy; with "global" the
            central copy holds the running statistics of the global batch.

    Example:
        >>> strategy = sg.CentralStorageStrategy(["cpu:0", "cpu:1"])     # parameters on the CPU
        >>> model, optimizer = strategy.distribute(net, torch.optim.Adam(net.parameters()))
        >>> for x, y in strategy.distribute_dataset(loader):
        ...     losses = strategy.run(train_step, args=(x, y))           # the same train_step as Mirrored
        ...     print(strategy.reduce("mean", losses))
    """

    # Parts, in the order a step meets them (each reports its own decisions to explain()):
    #   placement   mirrored_placement.place_replicas: the compute devices and their threads
    #   replicas    central_update.CentralUpdate: the central copy (parameters, optimizer state) and a compute
    #               copy per replica, refreshed at each step's start; the update, once, on the central device
    #   combine     CentralUpdate.local_combine: the weighted gradients summed on the central device and
    #               handed back (in memory when every replica computes on the central CPU)
    #   the set     replica_set.ReplicaSet: replica threads and barrier, run's weights, BatchNorm statistics,
    #               empty slices, declared loss weights (no_sync() changes nothing: every backward combines)

    def __init__(
        self,
        devices: Sequence[str | torch.device] | None = None,
        *,
        parameter_device: str | torch.device | None = None,
        share_parameters: bool = True,
        require_gpu: bool = False,
        timeout: float = 300.0,
        intra_op_threads: int | None = None,
        batch_norm: str = "global",
        registry: sg_devices.DeviceRegistry | None = None,
    ) -> None:
        if parameter_device is not None and not isinstance(parameter_device, (str, torch.device)):
            raise DeviceError(
                "parameter_device must be one device name. Received: "
                f"parameter_device={parameter_device!r} ({type(parameter_device).__name__}). "
                "Use e.g. parameter_device='cpu' or 'cuda:0' (TF spelling '/cpu:0' works too)."
            )
        if not isinstance(share_parameters, bool):
            raise InputError(
                f"share_parameters must be True or False. Received: share_parameters={share_parameters!r}. "
                "Use True (replicas on the central device read its parameters in place) or False (a copy each)."
            )
        mode = check_batch_norm_mode(batch_norm)
        timeout = check_timeout(timeout)
        placement = place_replicas(devices, require_gpu=False, registry=registry, intra_op_threads=intra_op_threads)
        if require_gpu and not any(d.type == "cuda" for d in placement.devices):
            raise GpuUnavailableError(_no_gpu_message(devices))
        self._update = CentralUpdate(placement, parameter_device, share_parameters, registry)
        self._replicas = ReplicaSet(
            self, placement, build=self._update, combine=self._update.local_combine(), batch_norm=mode, timeout=timeout
        )

    @property
    def parameter_device(self) -> torch.device:
        """The device that holds the parameters and the optimizer state."""
        return self._update.central_device


def _no_gpu_message(devices: Sequence[str | torch.device] | None) -> str:
    if devices is not None:
        return (
            f"require_gpu=True, but the devices given are not GPUs. Received: devices={list(map(str, devices))}. "
            "Name GPUs (e.g. ['cuda:0', 'cuda:1']) or drop require_gpu."
        )
    reason = diagnose.gpu_unavailable_reason(diagnose.collect_facts(environ.current()))
    detail = f" {reason.reason} {reason.fix}" if reason is not None else ""
    return f"require_gpu=True, but no GPU can be used, so CentralStorageStrategy would compute on the CPU.{detail}"
