"""Models, optimizers, batches and the plain one-device reference shared by the equivalence tests
(in-process and multi-worker)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Global batch sizes: uneven splits over 2 and 3 replicas, a last short batch, one smaller than 3 replicas.
BATCH_SIZES = [12, 11, 7, 2, 5]
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, 4),
    )


MODELS = {"mlp": (mlp, (6,)), "conv": (convnet, (2, 8, 8))}
OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def make_batches(shape, dtype, sizes=BATCH_SIZES, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn((n, *shape), generator=g, dtype=dtype), torch.randint(0, 4, (n,), generator=g)) for n in sizes]


def train_step(model, optimizer, *, clip=True):
    """The step of the equivalence loops, on one device or per replica: cross-entropy, backward, (`clip`) the
    gradient clipped to norm 1 (under a strategy it must see the combined gradient), an optimizer step."""

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


def train_reference(model, optimizer, batches, *, clip=True, epochs=1):
    """The plain one-device loop: train_step over `batches`, `epochs` times."""
    step = train_step(model, optimizer, clip=clip)
    for _ in range(epochs):
        for x, y in batches:
            step(x, y)
    return model, optimizer


def train_with(strategy, model, optimizer, batches):
    model, optimizer = strategy.distribute(model, optimizer)
    step = train_step(model, optimizer)
    losses = []
    for x, y in strategy.distribute_dataset(batches):
        losses.append(strategy.reduce("mean", strategy.run(step, args=(x, y))))
    return model, optimizer, losses


def assert_same_state(reference: nn.Module, model, dtype):
    ref = reference.state_dict()
    replicas = getattr(model, "replicas", [model])
    for replica in replicas:
        got = replica.state_dict()
        assert ref.keys() == got.keys()
        for key in ref:
            torch.testing.assert_close(got[key], ref[key], **TOL[dtype], msg=lambda m, k=key: f"{k}: {m}")


def build(model_name, opt_name, dtype):
    factory, shape = MODELS[model_name]
    torch.manual_seed(42)
    model = factory().to(dtype)
    return model, OPTIMIZERS[opt_name](model.parameters()), shape
