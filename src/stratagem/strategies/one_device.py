"""OneDeviceStrategy: everything on one device, with the same vocabulary as the others."""

from __future__ import annotations

import torch

from stratagem import devices as sg_devices
from stratagem.strategies.data_parallel.combine import choose_local_combine
from stratagem.strategies.data_parallel.mirrored_replicas import MirroredReplicas
from stratagem.strategies.data_parallel.placement import place_replicas
from stratagem.strategies.data_parallel.replica_set import ReplicaSet
from stratagem.strategies.data_parallel.replicated import ReplicatedStrategy, check_timeout


class OneDeviceStrategy(ReplicatedStrategy):
    """Places the model, the optimizer state and every batch on one device (tf.distribute.OneDeviceStrategy).

    Example:
        >>> strategy = sg.OneDeviceStrategy("cuda:0")
        >>> model, optimizer = strategy.distribute(Net(), torch.optim.Adam(net.parameters()))
    """

    # Parts: the placement of one device (mirrored_placement.place_replicas), the model itself as the one
    # replica (mirrored_replicas.MirroredReplicas), and a replica set of one, whose backward combines nothing.

    def __init__(
        self, device: str | torch.device, *, timeout: float = 300.0, registry: sg_devices.DeviceRegistry | None = None
    ) -> None:
        timeout = check_timeout(timeout)
        placement = place_replicas([device], require_gpu=False, registry=registry, intra_op_threads=None)
        combine = choose_local_combine(placement.devices, nccl_available=False)  # one replica: nothing to combine
        self._replicas = ReplicaSet(
            self, placement, build=MirroredReplicas(None), combine=combine, batch_norm="global", timeout=timeout
        )
