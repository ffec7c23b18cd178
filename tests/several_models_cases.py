"""Steps that use several models at once, written as for one device: a DCGAN-style iteration (a generator and a
discriminator, BatchNorm in both, an Adam each, the discriminator's gradients from two backward passes and the
generator's loss through the discriminator), a student trained against a frozen teacher, and an EMA copy of the
trained model. The in-process tests and tests/workers/several_models_train.py run them under a strategy and
compare with these functions run on plain modules."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

Z, FEATURES = 4, 6
GAN_SIZES = [6, 7, 5, 4]
"""Global batches; the last one short, and uneven over 2 and 3 replicas."""
EMA_DECAY = 0.8


def generator() -> nn.Module:
    return nn.Sequential(nn.Linear(Z, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, FEATURES), nn.Tanh())


def discriminator() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, 8, bias=False), nn.BatchNorm1d(8), nn.LeakyReLU(0.2), nn.Linear(8, 1), nn.Sigmoid()
    )


def build_gan() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(11)
    g, d = generator().double(), discriminator().double()
    return (
        g,
        d,
        torch.optim.Adam(g.parameters(), lr=0.01, betas=(0.5, 0.999)),
        torch.optim.Adam(d.parameters(), lr=0.02, betas=(0.5, 0.999)),
    )


def gan_batches(sizes=GAN_SIZES, seed=5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(real examples, noise): the noise is drawn here, from the global batch's generator, never inside the step."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.rand((n, FEATURES), generator=gen, dtype=torch.float64) * 2 - 1,
            torch.randn((n, Z), generator=gen, dtype=torch.float64),
        )
        for n in sizes
    ]


def gan_step(g, d, opt_g, opt_d):
    """pytorch/examples' DCGAN iteration over (real, noise)."""

    def step(real: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(real.shape[0], 1, dtype=real.dtype)
        zeros = torch.zeros(real.shape[0], 1, dtype=real.dtype)
        d.zero_grad()
        err_real = F.binary_cross_entropy(d(real), ones)
        err_real.backward()
        fake = g(noise)
        err_fake = F.binary_cross_entropy(d(fake.detach()), zeros)
        err_fake.backward()  # the discriminator's gradients accumulate over two backward passes
        opt_d.step()
        g.zero_grad()
        err_g = F.binary_cross_entropy(d(fake), ones)  # through the updated discriminator, into the generator
        err_g.backward()
        opt_g.step()
        return err_g.detach()

    return step


def build_distillation() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """A teacher with BatchNorm in eval mode (its running statistics are not all zero and one) and a student."""
    torch.manual_seed(12)
    teacher = discriminator()[:3].double()
    with torch.no_grad():
        teacher[1].running_mean.uniform_(-0.5, 0.5)
        teacher[1].running_var.uniform_(0.5, 1.5)
    teacher.eval()
    student = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 8)).double()
    return teacher, student, torch.optim.SGD(student.parameters(), lr=0.1, momentum=0.9)


def distillation_step(teacher, student, optimizer):
    def step(x: torch.Tensor, _noise: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = teacher(x)
        loss = F.mse_loss(student(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def averaged(model: nn.Module) -> AveragedModel:
    """torch's EMA of `model` (a copy of it; of a distributed model, a copy of the plain one)."""
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(EMA_DECAY))


def lerp_ema_(ema: nn.Module, model: nn.Module) -> None:
    """A hand-written EMA update, after the step."""
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.lerp_(p, 1 - EMA_DECAY)


def reference_gan(sizes=GAN_SIZES):
    """The GAN trained on one device; also its EMAs (torch's and hand-written) of the generator."""
    g, d, opt_g, opt_d = build_gan()
    ema, hand = averaged(g), copy.deepcopy(g)
    step = gan_step(g, d, opt_g, opt_d)
    for real, noise in gan_batches(sizes):
        step(real, noise)
        ema.update_parameters(g)
        lerp_ema_(hand, g)
    return g, d, ema, hand


def reference_distillation(sizes=GAN_SIZES):
    teacher, student, optimizer = build_distillation()
    step = distillation_step(teacher, student, optimizer)
    for x, noise in gan_batches(sizes):
        step(x, noise)
    return teacher, student


# ---- passes that reach different parameters ---------------------------------------------------------------------
# Each backward pass combines only the parameters it reached: a gradient an earlier pass combined is left bit for bit
# (the generator's below), whatever the later pass's weights; a parameter some replicas' passes reach and others' do
# not (an expert only some slices route examples to) still combines with what every replica holds.


def token_gan_batches(sizes=GAN_SIZES) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(real, noise, tokens): each example's token count (1 to 5), which weighs its discriminator loss."""
    gen = torch.Generator().manual_seed(7)
    return [
        (real, noise, torch.randint(1, 6, (real.shape[0],), generator=gen).double())
        for real, noise in gan_batches(sizes)
    ]


def token_gan_step(g, d, opt_g, opt_d, declare=None):
    """A GAN iteration of two backward passes: the generator's loss through the discriminator first (mean over
    examples; the generator's gradient is kept until its step at the end), then the discriminator's, a mean over
    tokens whose count `declare` (sg.set_loss_weight under a strategy, None on one device) declares. Returns how much
    the discriminator's pass changed the generator's gradient (it does not reach the generator: 0)."""

    def step(real: torch.Tensor, noise: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(real.shape[0], 1, dtype=real.dtype)
        zeros = torch.zeros(real.shape[0], 1, dtype=real.dtype)
        opt_g.zero_grad()
        opt_d.zero_grad()
        fake = g(noise)
        F.binary_cross_entropy(d(fake), ones).backward()
        d.zero_grad()  # the discriminator's gradient of the generator's loss is dropped
        kept = [p.grad.clone() for p in g.parameters()]
        per_example = F.binary_cross_entropy(d(real), ones, reduction="none") + F.binary_cross_entropy(
            d(fake.detach()), zeros, reduction="none"
        )
        if declare is not None:
            declare(tokens.sum())
        err_d = (per_example.squeeze(1) * tokens).sum() / tokens.sum()
        err_d.backward()
        change = max(float((p.grad - k).abs().max()) for p, k in zip(g.parameters(), kept))
        opt_d.step()
        opt_g.step()
        return torch.tensor(change, dtype=torch.float64)

    return step


def reference_token_gan(sizes=GAN_SIZES):
    g, d, opt_g, opt_d = build_gan()
    step = token_gan_step(g, d, opt_g, opt_d)
    for batch in token_gan_batches(sizes):
        step(*batch)
    return g, d


ROUTED_SIZES = [6, 7, 2, 5]
"""Global batches; one smaller than 3 replicas (an empty slice)."""


class Routed(nn.Module):
    """A shared layer and two heads; the second ("expert") only for the examples whose first feature exceeds 0.6, and
    not called at all on a slice without one, so its parameters are reached on some replicas only."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(FEATURES, 4)
        self.head = nn.Linear(4, 1)
        self.expert = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(x))
        out = self.head(h)
        routed = x[:, 0] > 0.6
        if bool(routed.any()):
            out = out.index_add(0, routed.nonzero().squeeze(1), self.expert(h[routed]))
        return out


def build_routed() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(13)
    net = Routed().double()
    return net, torch.optim.Adam(net.parameters(), lr=0.05)


def routed_batches(sizes=ROUTED_SIZES) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(9)
    return [
        (torch.rand((n, FEATURES), generator=gen, dtype=torch.float64) * 2 - 1, torch.randn((n, 1), generator=gen))
        for n in sizes
    ]


def routed_step(net, optimizer):
    """A weight penalty's backward pass first (it reaches every parameter on every replica), then the data loss's,
    which reaches the expert only where the slice routes an example to it."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        (1e-2 * sum(p.pow(2).sum() for p in net.parameters())).backward()
        loss = F.mse_loss(net(x), y.to(x.dtype))
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def reference_routed(sizes=ROUTED_SIZES):
    net, optimizer = build_routed()
    step = routed_step(net, optimizer)
    for batch in routed_batches(sizes):
        step(*batch)
    return net
