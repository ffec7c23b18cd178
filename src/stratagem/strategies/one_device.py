"""OneDeviceStrategy: everything on one device, with the same vocabulary as the others."""

from __future__ import annotations

import torch

from stratagem import devices as sg_devices
from stratagem.strategies.mirrored import MirroredStrategy


class OneDeviceStrategy(MirroredStrategy):
    """Places the model, the optimizer state and every batch on one device (tf.distribute.OneDeviceStrategy).

    Example:
        >>> strategy = sg.OneDeviceStrategy("cuda:0")
        >>> model, optimizer = strategy.distribute(Net(), torch.optim.Adam(net.parameters()))
    """

    def __init__(
        self, device: str | torch.device, *, timeout: float = 300.0, registry: sg_devices.DeviceRegistry | None = None
    ) -> None:
        super().__init__([device], timeout=timeout, registry=registry)
