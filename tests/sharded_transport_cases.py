"""What tests/test_sharded_transport.py's ranks run: ShardedStrategy with its all-gathers and reduce-scatters
through shared memory (the default on one host) and through the process group, against one device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from sharded_cases import OPTIMIZERS, batches, clipped_step, cluster_of, full, mlp, train_one_device

# Stage 3 through shared memory is the default in tests/test_sharded_strategy.py and test_sharded_numerics.py.
CASES = (
    ("stage 2 shared memory", 2, {}),
    ("stage 2 gloo", 2, {"shared_memory": False}),
    # A unit per Linear: each unit's all-to-all stays under way while backward makes the next unit's gradients.
    ("stage 2 gloo, a unit per layer", 2, {"shared_memory": False, "units": (torch.nn.Linear,)}),
)


def transport_cases(rank: int, ports: list[tuple[int, int]]) -> dict[str, Any]:
    """Per case: the worst relative error against one device (float64, AdamW, 13 examples split 7/6), what
    explain() says of the transport, the memory plan's transport bytes, and how many all-gathers and reduce-scatters went through the process group."""
    import stratagem as sg

    calls = {"all_gather_single": 0, "reduce_scatter_single": 0, "all_to_all_single": 0, "async": 0}
    for name in list(calls)[:3]:  # counted in this rank only: FSDP2's and the strategy's calls into torch.distributed
        setattr(dist, name, _counted(getattr(dist, name), calls, name))
    data = batches(torch.float64)
    reference = mlp(torch.float64)
    train_one_device(reference, OPTIMIZERS["adamw"](reference.parameters()), data, 0.5, 1)
    out: dict[str, Any] = {}
    for (case, stage, options), pair in zip(CASES, ports):
        strategy = sg.ShardedStrategy(stage=stage, cluster=cluster_of(rank, pair), timeout=60, **options)
        for name in calls:
            calls[name] = 0
        try:
            user_model = mlp(torch.float64)
            model, opt = strategy.distribute(user_model, OPTIMIZERS["adamw"](user_model.parameters()))
            step = clipped_step(model, opt)
            for x, y in strategy.distribute_dataset(data):
                strategy.run(step, args=(x, y))
            worst = max(
                float((full(p).detach() - q.detach()).abs().max() / q.detach().abs().max())
                for p, q in zip(model.parameters(), reference.parameters())
            )
            out[case] = {
                "worst": worst,
                "explain": str(strategy.explain()),
                "calls": dict(calls),
                "plan_transport": strategy.memory_plan().transport,
                "plan_gathered": strategy.memory_plan().gathered_peak,
            }
        finally:
            strategy.close()
    return out


def _counted(function: Callable[..., Any], calls: dict[str, int], name: str) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        calls["async"] += bool(kwargs.get("async_op"))
        return function(*args, **kwargs)

    return counted
