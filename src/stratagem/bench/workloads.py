"""The reference workloads, as specified in shared/peers/README.md, so figures compare with the peers.

mlp: 512 -> 1024 -> ReLU -> 1024 -> ReLU -> 10, global batch 256.
cnn: 3x32x32 -> conv3x3(32) -> ReLU -> maxpool2 -> conv3x3(64) -> ReLU -> maxpool2 -> dense 10, global batch 128.
Both: softmax cross-entropy, SGD lr 0.01 momentum 0.9, float32, a pool of 8 synthetic global batches
whose labels come from a fixed random linear teacher (so the loss really falls).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

POOL_BATCHES = 8
LR = 0.01
MOMENTUM = 0.9


@dataclass(frozen=True)
class Workload:
    name: str
    global_batch: int
    input_shape: tuple[int, ...]
    classes: int = 10

    def build_model(self, seed: int = 1234) -> nn.Module:
        torch.manual_seed(seed)
        if self.name == "mlp":
            return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(8 * 8 * 64, 10),
        )

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def make_batches(self, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        n = self.global_batch * POOL_BATCHES
        x = torch.randn((n, *self.input_shape), generator=g)
        teacher = torch.randn((x[0].numel(), self.classes), generator=g)
        y = (x.reshape(n, -1) @ teacher).argmax(dim=1)
        b = self.global_batch
        return [(x[i * b : (i + 1) * b].contiguous(), y[i * b : (i + 1) * b].contiguous()) for i in range(POOL_BATCHES)]


WORKLOADS = {
    "mlp": Workload("mlp", 256, (512,)),
    "cnn": Workload("cnn", 128, (3, 32, 32)),
}
