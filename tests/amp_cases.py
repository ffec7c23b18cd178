"""bf16 and loss-scaled training loops, on one device (strategy None) and under a strategy, shared by
tests/test_autocast.py and the multi-worker script tests/workers/mwms_amp.py."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from cases import make_batches, mlp, train_step

BF16_EPS = 2.0**-7
"""bfloat16's machine epsilon (8 significant bits): the tolerance unit of the bf16 comparisons."""


def _bf16(enabled: bool = True):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


def overflow_batches():
    """Four global batches; the last example of step 1 is inf (in the last replica's slice only)."""
    batches = make_batches((6,), torch.float32, sizes=[12, 11, 7, 12])
    batches[1][0][-1, 0] = math.inf
    return batches


def train_bf16(strategy, batches):
    torch.manual_seed(42)
    net = mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    if strategy is None:
        for x, y in batches:
            with _bf16():
                loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return net.state_dict()
    model, opt = strategy.distribute(net, opt)
    step = train_step(model, opt, clip=False)
    for x, y in strategy.distribute_dataset(batches):
        with _bf16():
            strategy.run(step, args=(x, y))
    return model.state_dict()


def _scaled_step(model, opt, scaler, x, y):
    """One loss-scaled step (on one device or per replica): backward of the scaled loss, the gradient unscaled
    and clipped to norm 1, the scaler's step and update; returns the scale after it."""
    loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return scaler.get_scale()


def train_scaled(strategy, batches):
    """fp32 weights with a GradScaler (on the CPU); returns the state and the scale after every step."""
    torch.manual_seed(42)
    net = mlp()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scales = []
    if strategy is None:
        for x, y in batches:
            scales.append([_scaled_step(net, opt, scaler, x, y)])
        return net.state_dict(), scales
    model, opt = strategy.distribute(net, opt)
    scaler = strategy.distribute_scaler(scaler)

    def step(x, y):
        return _scaled_step(model, opt, scaler, x, y)

    for x, y in strategy.distribute_dataset(batches):
        scales.append(list(strategy.experimental_local_results(strategy.run(step, args=(x, y)))))
    return model.state_dict(), scales
