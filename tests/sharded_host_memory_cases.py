"""What tests/test_sharded_host_memory.py's ranks run: the same stage-2 training under host_memory="release" and
"reuse" in one process, with the page faults of the steps after the switch."""

from __future__ import annotations

import resource
from typing import Any

import torch
from sharded_cases import cluster_of
from torch import nn

WIDTH = 256  # each weight 256 KiB in float32: above the strategy's 64 KiB mapping threshold


def host_memory_cases(rank: int, ports: list[tuple[int, int]]) -> dict[str, Any]:
    """Per choice: the parameters after 6 steps (full, gathered), minor page faults per step over steps 3-6, what
    explain() and the plan say, and the worker's flight record of its last collectives."""
    import stratagem as sg

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, WIDTH, generator=g), torch.randn(16, WIDTH, generator=g)) for _ in range(6)]
    out: dict[str, Any] = {}
    for choice, pair in zip(("release", "reuse"), ports):
        # A unit per Linear (stage 2 would keep this 768 KiB model as one unit): three of each collective a step.
        strategy = sg.ShardedStrategy(
            stage=2, units=(nn.Linear,), cluster=cluster_of(rank, pair), timeout=60, host_memory=choice
        )
        try:
            torch.manual_seed(0)
            net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(3)])
            model, opt = strategy.distribute(net, torch.optim.AdamW(net.parameters(), lr=0.01))

            def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                return loss.detach()

            batches = list(strategy.distribute_dataset(data))
            faults = 0
            for i, (x, y) in enumerate(batches):
                if i == 2:
                    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                strategy.run(step, args=(x, y))
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            out[choice] = {
                "params": [p.full_tensor().detach().flatten().tolist() for p in model.parameters()],  # exact floats
                "faults_per_step": faults / (len(batches) - 2),
                "explain": str(strategy.explain()),
                "allocator": strategy.memory_plan().allocator,
                "flight": strategy.worker_group.cross_worker.flight.entries(),
            }
        finally:
            strategy.close()
    return out
