"""What tests/test_sharded_units.py's ranks run: stage 2's default cut, which merges small consecutive blocks, and
the same model cut by the user one Linear per unit, each trained against one device."""

from __future__ import annotations

from typing import Any

import torch
from sharded_cases import cluster_of, full
from torch import nn

WIDTH = 512  # a trunk block, Linear(512, 512) in float64, holds 2.0 MiB: four are over stage 2's 8 MiB


class Heads(nn.Module):
    """A trunk of 5 blocks that form a chain, then 2 heads that run side by side on the trunk's output."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(5)])
        self.heads = nn.ModuleList([nn.Linear(WIDTH, 3), nn.Linear(WIDTH, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.trunk:
            x = torch.tanh(block(x))
        # The heads' merged unit reduce-scatters when the gradient reaches heads.0's input, which heads.1 shares.
        return self.heads[0](x) * self.heads[1](x)


def heads_model() -> Heads:
    torch.manual_seed(0)
    return Heads().to(torch.float64)


def heads_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(n, WIDTH, generator=g, dtype=torch.float64), torch.randn(n, 3, generator=g, dtype=torch.float64))
        for n in (13, 5, 13)
    ]


def step_of(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def merged_units_cases(rank: int, ports: list[tuple[int, int]]) -> dict[str, Any]:
    """Per cut (stage 2's default, then units=(nn.Linear,)): the worst relative error against one device after 3
    SGD steps with momentum on uneven batches, what explain() says of the units, and the collectives of each step;
    and how many parameter values differ between the two cuts."""
    import stratagem as sg

    data = heads_batches()
    reference = heads_model()
    step = step_of(reference, optimizer(reference))
    for x, y in data:
        step(x, y)
    out: dict[str, Any] = {}
    finals: dict[str, list[torch.Tensor]] = {}
    for (case, units), pair in zip((("default", None), ("every Linear", (nn.Linear,))), ports):
        strategy = sg.ShardedStrategy(stage=2, units=units, cluster=cluster_of(rank, pair), timeout=60)
        try:
            net = heads_model()
            model, opt = strategy.distribute(net, optimizer(net))
            for x, y in strategy.distribute_dataset(data):
                strategy.run(step_of(model, opt), args=(x, y))
            flight = strategy.worker_group.cross_worker.flight.entries()
            finals[case] = [full(p).detach().clone() for p in model.parameters()]
            out[case] = {
                "worst": max(
                    float((p - q.detach()).abs().max() / q.detach().abs().max())
                    for p, q in zip(finals[case], reference.parameters())
                ),
                "explain": str(strategy.explain()),
                "gathers per step": [
                    sum(1 for e in flight if e["step"] == s and e["what"] == "all-gather of parameters")
                    for s in range(len(data))
                ],
                "reduce-scatters per step": [
                    sum(1 for e in flight if e["step"] == s and e["what"] == "reduce-scatter of gradients")
                    for s in range(len(data))
                ],
            }
        finally:
            strategy.close()
    out["bits differing between the cuts"] = sum(
        int((a != b).sum()) for a, b in zip(finals["default"], finals["every Linear"], strict=True)
    )
    return out


def foreach_cases(rank: int, port: int) -> dict[str, int]:
    """Per optimizer of `optimizer.FOREACH_EXACT` and dtype: how many parameter values differ after 4 steps between
    its foreach step over FSDP2's DTensor shards (one rank) and its loop over the same model's plain tensors."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from stratagem.strategies.sharded.optimizer import FOREACH_EXACT

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    out: dict[str, int] = {}
    for dtype in (torch.float32, torch.float64):
        for cls in FOREACH_EXACT:
            torch.manual_seed(0)
            plain = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)
            torch.manual_seed(0)
            sharded = fully_shard(nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype))
            options = {"lr": 0.1, "momentum": 0.9} if cls is torch.optim.SGD else {}
            pairs = (
                (plain, cls(plain.parameters(), **options)),
                (sharded, cls(sharded.parameters(), foreach=True, **options)),
            )
            for i in range(4):
                x = torch.randn(6, 5, dtype=dtype, generator=torch.Generator().manual_seed(i))
                for model, opt in pairs:
                    model(x).pow(2).sum().backward()
                    opt.step()
                    opt.zero_grad()
            out[f"{cls.__name__} {str(dtype).removeprefix('torch.')}"] = sum(
                int((full(p).detach() != q.detach()).sum()) for p, q in zip(sharded.parameters(), plain.parameters())
            )
    dist.destroy_process_group()
    return out
