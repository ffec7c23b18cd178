"""What the ranks of tests/test_sharded_scope.py run: models built inside `ShardedStrategy.scope()` against the same
constructors run on one device with the same seed."""

from __future__ import annotations

from typing import Any

import torch
from sharded_cases import cluster_of, full, pytest_refusal
from torch import nn

GLOBAL_BATCH = 13  # 7 + 6 over 2 ranks


def sequential() -> nn.Module:
    """Embedding, Linear and LayerNorm in float64; 17 rows do not divide by 2 (padded shards)."""
    return nn.Sequential(nn.Embedding(13, 6), nn.Linear(6, 17), nn.Tanh(), nn.LayerNorm(17), nn.Linear(17, 5)).double()


def gpt2_init(module: nn.Module) -> None:
    """A model-level `apply(init_fn)` after construction, as nanoGPT's `_init_weights`."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        nn.init.zeros_(module.bias)


def normal_matrices(module: nn.Module) -> None:
    """Every matrix of a module drawn again (GPT-2's Conv1D, embeddings and tied head)."""
    for p in module.parameters(recurse=False):
        if p.dim() == 2:
            nn.init.normal_(p, mean=0.0, std=0.02)


def built(make: Any, seed: int, strategy: Any = None, apply: Any = None) -> tuple[nn.Module, Any, torch.Tensor]:
    """`make()` after `torch.manual_seed(seed)`, inside `strategy.scope()` when given, then `apply` and an SGD
    optimizer made inside it (as TensorFlow's scope holds them); and the generator's next draw after the scope."""
    import contextlib

    torch.manual_seed(seed)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = make()
        if apply is not None:
            model.apply(apply)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer, torch.rand(3)


def differing(model: nn.Module, reference: nn.Module) -> list[str]:
    """The names whose (gathered) value is not bit-identical to the reference's."""
    expected = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    got = [*model.named_parameters(), *model.named_buffers()]
    return [name for name, t in got if not torch.equal(full(t).detach(), expected[name].detach())]


def scope_cases(rank: int, ports: tuple[int, int]) -> dict[str, Any]:
    from zoo import tiny_gpt2

    import stratagem as sg

    out: dict[str, Any] = {}
    strategy = sg.ShardedStrategy(cluster=cluster_of(rank, ports), timeout=60)
    try:
        reference, ref_opt, next_draw = built(sequential, 7, apply=gpt2_init)
        model, opt, after = built(sequential, 7, strategy, apply=gpt2_init)
        out["sequential differing"] = differing(model, reference)
        out["sequential sharded"] = [type(p).__name__ for p in model.parameters()]
        out["sequential local rows"] = [p.to_local().shape[0] for p in model.parameters()]
        out["draw after the scope"] = torch.equal(after, next_draw)
        out["sequential trained"] = _train(strategy, (model, opt), (reference, ref_opt))

        reference, _, next_draw = built(lambda: tiny_gpt2().to(torch.float64), 0)
        gpt, _, after = built(lambda: tiny_gpt2().to(torch.float64), 0, strategy)
        out["gpt2 differing"] = differing(gpt, reference)
        out["gpt2 tied"] = gpt.lm_head.weight is gpt.transformer.wte.weight
        out["gpt2 draw after the scope"] = torch.equal(after, next_draw)

        # Initialized again inside a later scope, on the sharded parameters: one device's draws, whole.
        torch.manual_seed(11)
        reference.apply(normal_matrices)
        torch.manual_seed(11)
        with strategy.scope():
            gpt.apply(normal_matrices)
        out["gpt2 again differing"] = differing(gpt, reference)

        half = torch.full((), 0.5, dtype=torch.float64)
        with pytest_refusal() as refused:
            with strategy.scope():
                gpt.transformer.wte.weight.data.bernoulli_(half)
        out["refused sharded draw"] = refused.message
        with pytest_refusal() as refused:
            with strategy.scope():
                layer = nn.Linear(4, 4)
                layer.weight.data.mul_(1.0 / float(layer.weight.abs().max()))  # reads a value not built yet
        out["refused item"] = refused.message
        with pytest_refusal() as refused:
            with strategy.scope():
                normed = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))  # noqa: F841 (built when the scope ends)
        out["refused batch norm"] = refused.message
    finally:
        strategy.close()
    return out


def _train(strategy: Any, built: tuple[nn.Module, Any], one_device: tuple[nn.Module, Any]) -> float:
    """Two SGD steps on global batches of 13 against one device (the optimizer made inside the scope, over the
    parameters as construction made them): the largest relative difference."""
    reference, ref_opt = one_device
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randint(0, 13, (GLOBAL_BATCH,), generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g).double())
        for _ in range(2)
    ]
    for x, y in data:
        nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model, opt = strategy.distribute(*built)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    for x, y in strategy.distribute_dataset(data):
        strategy.run(step, args=(x, y))
    expected = dict(reference.named_parameters())
    return max(
        float((full(p).detach() - expected[name].detach()).abs().max() / expected[name].detach().abs().max())
        for name, p in model.named_parameters()
    )
