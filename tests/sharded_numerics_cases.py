"""What the ranks of tests/test_sharded_numerics.py run: ShardedStrategy against plain PyTorch on one device for
BatchNorm (global statistics), a bf16 MixedPrecisionPolicy, and tiny GPT-2 in float32 and with AdamW."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from sharded_cases import GLOBAL_BATCH, STEPS, cluster_of, full, gpt2_batches
from torch import nn


class ResBlock(nn.Module):
    """A ResNet basic block: conv, BatchNorm, ReLU, conv, BatchNorm, the input added back."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


def small_resnet(dtype: torch.dtype) -> nn.Module:
    """A ResNet-18-like stem and two basic blocks (5 BatchNorm layers; the stem's BatchNorm a unit of its own)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        ResBlock(4),
        ResBlock(4),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    ).to(dtype)


def image_batches(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [
        (
            torch.randn(GLOBAL_BATCH, 3, 6, 6, generator=g, dtype=dtype),
            torch.randint(0, 3, (GLOBAL_BATCH,), generator=g),
        )
        for _ in range(STEPS)
    ]


def worst_relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest |got - want| over max |want| of any tensor, and its name (integer counters compared exactly)."""
    errors = {}
    for name, expected in want.items():
        value = full(got[name]).detach()
        if not expected.is_floating_point():
            errors[name] = 0.0 if torch.equal(value, expected) else float("inf")
            continue
        errors[name] = float((value - expected).abs().max() / expected.abs().max().clamp(min=1e-30))
    name = max(errors, key=errors.__getitem__)
    return errors[name], name


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def numerics_cases(rank: int, ports: list[tuple[int, int]]) -> dict[str, Any]:
    """Each case with a strategy of its own on 2 ranks: the worst relative error against one device."""
    import stratagem as sg

    cases: list[tuple[str, dict[str, Any], Callable[[Any], Any]]] = [
        ("batch norm float64", {}, lambda s: _batch_norm_case(s, torch.float64)),
        ("batch norm float32", {}, lambda s: _batch_norm_case(s, torch.float32)),
        ("bf16 policy", {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}, _bf16_case),
        ("gpt2 float64 adamw", {}, lambda s: _gpt2(s, torch.float64, "adamw")),
        ("gpt2 float32 sgd", {}, lambda s: _gpt2(s, torch.float32, "sgd")),
        ("other dtype on rank 1", {}, lambda s: _mismatch_case(s, rank)),
        ("sharded in place", {}, _in_place_case),
    ]
    out: dict[str, Any] = {}
    for (name, options, case), pair in zip(cases, ports):
        strategy = sg.ShardedStrategy(cluster=cluster_of(rank, pair), timeout=60, **options)
        try:
            out[name] = case(strategy)
        finally:
            strategy.close()
    return out


def _batch_norm_case(strategy: Any, dtype: torch.dtype) -> dict[str, Any]:
    """SGD with momentum on 13 images split 7/6: parameters and running statistics against one device."""
    data = image_batches(dtype)
    reference = small_resnet(dtype)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    user_model = small_resnet(dtype)
    model, opt = strategy.distribute(user_model, torch.optim.SGD(user_model.parameters(), lr=0.1, momentum=0.9))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    for x, y in strategy.distribute_dataset(data):
        strategy.run(step, args=(x, y))
    worst, name = worst_relative(state(model), state(reference))
    model.eval()
    with torch.no_grad():  # evaluation reads the running statistics, the same on every rank
        evaluated = float((model(data[0][0]) - reference.eval()(data[0][0])).abs().max())
    return {"worst": worst, "where": name, "eval": evaluated, "explain": str(strategy.explain())}


def _mismatch_case(strategy: Any, rank: int) -> str:
    """Rank 1 builds the model in float64: distribute refuses on every rank, before any step all-gathers."""
    from sharded_cases import mlp, pytest_refusal

    with pytest_refusal() as refused:
        net = mlp(torch.float64 if rank == 1 else torch.float32)
        strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return refused.message


def _in_place_case(strategy: Any) -> dict[str, Any]:
    """distribute() shards the user's module in place, as fully_shard does: the model handed back holds it, and once
    the user's optimizer (passed inline) is dropped no whole parameter of it is referenced anywhere."""
    import gc
    import weakref

    from sharded_cases import mlp

    net = mlp(torch.float32)
    whole = [weakref.ref(p) for p in net.parameters()]
    shapes = [tuple(p.shape) for p in net.parameters()]
    model, opt = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1))
    gc.collect()
    return {
        "same module": model.module is net,
        "whole parameters alive": sum(ref() is not None for ref in whole),
        "local rows": [p.to_local().shape[0] for p in net.parameters() if p.dim()],
        "whole rows": [s[0] for s in shapes if len(s)],
    }


def _bf16_case(strategy: Any) -> dict[str, Any]:
    """Parameters gathered in bf16, gradients reduced in float32, against one device under bf16 autocast."""
    from amp_cases import train_bf16
    from cases import make_batches, mlp, train_step

    data = make_batches((6,), torch.float32, sizes=[GLOBAL_BATCH] * STEPS)
    expected = train_bf16(None, data)
    torch.manual_seed(42)
    net = mlp()
    model, opt = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    step = train_step(model, opt, clip=False)
    for x, y in strategy.distribute_dataset(data):
        strategy.run(step, args=(x, y))
    got = dict(model.named_parameters())
    # Per tensor: the error over the tensor's largest magnitude (the bf16 tolerance of tests/test_autocast.py).
    return {
        name: float((full(got[name]).detach() - want).abs().max() / want.abs().max()) for name, want in expected.items()
    }


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The next-token loss in the logits' dtype: transformers' own (`output.loss`) casts float64 logits to float32,
    whose rounding of each slice's gradient is then 5e-8 off one device's (the same on one device computing the
    slices apart), and AdamW turns that into whole steps on gradients that are zero in exact arithmetic."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def _gpt2(strategy: Any, dtype: torch.dtype, optimizer: str) -> dict[str, Any]:
    """Tiny GPT-2 with tied embeddings, -100 padding and declared token counts, against one device."""
    from zoo import tiny_gpt2

    import stratagem as sg

    def make_opt(params: Any) -> torch.optim.Optimizer:
        if optimizer == "adamw":
            return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    torch.manual_seed(0)
    user_model = tiny_gpt2().to(dtype)
    reference = copy.deepcopy(user_model)
    ref_opt = make_opt(reference.parameters())
    batches = gpt2_batches()
    for batch in batches:
        lm_loss(reference(input_ids=batch["input_ids"]).logits, batch["labels"]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model, opt = strategy.distribute(user_model, make_opt(user_model.parameters()))

    def lm_step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = lm_loss(model(input_ids=batch["input_ids"]).logits, batch["labels"])
        sg.set_loss_weight((batch["labels"][:, 1:] != -100).sum())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    for batch in strategy.distribute_dataset(batches):
        strategy.run(lm_step, args=(batch,))
    worst, name = worst_relative(dict(model.named_parameters()), dict(reference.named_parameters()))
    return {"worst": worst, "where": name}
