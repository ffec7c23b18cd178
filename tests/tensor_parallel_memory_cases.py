"""What the tensor-parallel memory test's ranks run: a small MLP split over 2 model workers, its plan against the
bytes each rank holds after a step, and a plan with the step's activations measured on the split model."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def mlp() -> nn.Module:
    """Linear(8, 5) split along its output features (5 rows: 3 and 2), Linear(5, 3) along its input features."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 3)).to(torch.float64)


def layout_map(mesh: Any) -> Any:
    import stratagem as sg

    layouts = sg.LayoutMap(mesh)
    layouts[r"0\.weight"] = ("model", None)
    layouts[r"0\.bias"] = ("model",)
    layouts[r"2\.weight"] = (None, "model")
    return layouts


def plan_against_held(rank: int, ports: list[int]) -> dict[str, Any]:
    import stratagem as sg
    from stratagem.strategies.state_memory import measured_local_bytes

    cluster = {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": rank}}
    strategy = sg.TensorParallelStrategy(layout_map(sg.DeviceMesh((2,), ("model",))), cluster=cluster, timeout=120)
    try:
        user = mlp()
        before = strategy.memory_plan(user, torch.optim.AdamW(user.parameters()))
        model, opt = strategy.distribute(user, torch.optim.AdamW(user.parameters(), lr=0.1))
        after = strategy.memory_plan()
        x = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        measured = strategy.memory_plan(example_inputs=(x,))  # every worker together: a step with no update
        untouched = all(p.grad is None for p in model.parameters())

        def step(x: torch.Tensor) -> None:
            model(x).square().sum().backward()
            opt.step()

        strategy.run(step, args=(x,))
        return {
            "before": before.to_dict(),
            "after": after.to_dict(),
            "measured": measured.to_dict(),
            "held": measured_local_bytes(model.parameters(), opt),
            "untouched": untouched,
            "explain": str(strategy.explain()),
        }
    finally:
        strategy.close()
