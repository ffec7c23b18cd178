"""Issue 39, item 8: is the tiny GPT-2's float32 AdamW gap to one device rounding or a defect?

    PYTHONPATH=src .venv/bin/python benchmarks/sharded_gpt2_float32.py [--steps 3] [--workers 2]

The case of `tests/sharded_numerics_cases.py::_gpt2`: tiny GPT-2 (vocab 48, 16 positions, width 32, 2 blocks, tied
embeddings), global batches of 13 sequences with -100 padding of varying length, AdamW (lr 0.01, weight decay
0.1), the next-token loss in the logits' dtype, each rank's loss weighted by its token count. Printed, as the
largest |a - b| / max |b| over the parameter tensors, and the tensor where it is:

- ShardedStrategy(stage=3) on N workers against one device, in float32 and in float64 (`stratagem launch`);
- one device against itself in float32, changed only where rounding can change it: the global batch summed as the
  N ranks' slices weighted by their token counts (the sharded run's reduction order, done on one device); one
  initial weight moved by one ulp; the same runs with SGD (momentum 0.9, lr 0.1) instead of AdamW.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

GLOBAL_BATCH = 13


def tiny_gpt2(dtype: torch.dtype) -> nn.Module:
    from stratagem.bench.zoo import gpt2

    torch.manual_seed(0)
    return gpt2(vocab=48, positions=16, width=32, layers=2, heads=2).to(dtype)


def batches(steps: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(1, 48, (GLOBAL_BATCH, 8), generator=g)
        labels = ids.clone()
        lengths = torch.randint(2, 9, (GLOBAL_BATCH,), generator=g)
        labels[torch.arange(8)[None, :] >= lengths[:, None]] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def worst_relative(got: nn.Module, want: nn.Module) -> tuple[float, str]:
    errors = {}
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        errors[name] = float((value.detach() - q.detach()).abs().max() / q.detach().abs().max().clamp(min=1e-30))
    name = max(errors, key=errors.__getitem__)
    return errors[name], name


def train_one_device(model: nn.Module, optimizer: str, data: list[dict[str, torch.Tensor]], slices: int = 1) -> None:
    """Plain PyTorch; `slices` > 1 sums the gradient of each global batch as that many contiguous slices, each
    weighted by its share of the tokens, as the sharded ranks' reduce-scatter does."""
    opt = make_optimizer(optimizer, model.parameters())
    for batch in data:
        ids, labels = batch["input_ids"], batch["labels"]
        sizes = [GLOBAL_BATCH // slices + (1 if r < GLOBAL_BATCH % slices else 0) for r in range(slices)]
        total = int((labels[:, 1:] != -100).sum())
        start = 0
        for size in sizes:
            part = slice(start, start + size)
            start += size
            weight = int((labels[part, 1:] != -100).sum()) / total  # a Python float: exact enough for float64
            (weight * lm_loss(model(input_ids=ids[part]).logits, labels[part])).backward()
        opt.step()
        opt.zero_grad()


def worker(args: argparse.Namespace) -> None:
    import stratagem as sg

    dtype = {"float32": torch.float32, "float64": torch.float64}[args.dtype]
    strategy = sg.ShardedStrategy(stage=3)
    data = batches(args.steps)
    results: dict[str, Any] = {}
    for optimizer in ("adamw", "sgd"):
        net = tiny_gpt2(dtype)
        reference = copy.deepcopy(net)
        train_one_device(reference, optimizer, data)
        model, opt = strategy.distribute(net, make_optimizer(optimizer, net.parameters()))

        def step(batch: dict[str, torch.Tensor], model: Any = model, opt: Any = opt) -> torch.Tensor:
            loss = lm_loss(model(input_ids=batch["input_ids"]).logits, batch["labels"])
            sg.set_loss_weight((batch["labels"][:, 1:] != -100).sum())
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        for batch in strategy.distribute_dataset(data):
            strategy.run(step, args=(batch,))
        results[f"sharded x{strategy.num_replicas_in_sync} {optimizer}"] = worst_relative(model, reference)
        if strategy.is_chief:  # one device against itself, changed only in its rounding
            split = tiny_gpt2(dtype)
            train_one_device(split, optimizer, data, slices=strategy.num_replicas_in_sync)
            results[f"one device, {strategy.num_replicas_in_sync} weighted slices {optimizer}"] = worst_relative(
                split, reference
            )
            nudged = tiny_gpt2(dtype)
            with torch.no_grad():
                w = nudged.transformer.h[0].mlp.c_fc.weight
                w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(float("inf"), dtype=dtype))
            train_one_device(nudged, optimizer, data)
            results[f"one device, one weight one ulp up {optimizer}"] = worst_relative(nudged, reference)
    if strategy.is_chief:
        print("RESULT " + json.dumps({"dtype": args.dtype, **results}), flush=True)
    strategy.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from stratagem import environ
    from stratagem.cluster import launch

    print("| dtype | run | worst |a - b| / max |b| | where |")
    print("|---|---|---|---|")
    for dtype in ("float32", "float64"):
        lines: list[str] = []
        command = [sys.executable, __file__, "--worker", "--dtype", dtype, "--steps", str(args.steps)]
        result = launch(
            command,
            workers=args.workers,
            env=dict(environ.current()),
            sink=lambda line: lines.append(line.text),
            timeout=600,
        )
        rows = [json.loads(t.split("RESULT ", 1)[1]) for t in lines if "RESULT " in t]
        if result.exit_code != 0 or not rows:
            print(f"{dtype}: exit code {result.exit_code}", *lines[-30:], sep="\n")
            continue
        for name, figure in rows[0].items():
            if name != "dtype":
                print(f"| {dtype} | {name} | {figure[0]:.2e} | {figure[1]} |", flush=True)


if __name__ == "__main__":
    main()
