"""What the check before every step costs: the replicas follow what a script did to the model between steps
(strategies/data_parallel/outside_changes.py), compared by identity and version counters.

Measures `OutsideChanges.replay()` (nothing changed: the check alone) plus `after_run()` (the tensors' states
taken again), the work the replica set adds to each `run`, on a 4-module MLP and on a 12-layer GPT-2 (164
modules), against the plain step of the same model on one device.

    .venv/bin/python benchmarks/outside_changes.py [--rounds 2000]
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
from torch import nn

from stratagem.strategies.data_parallel.outside_changes import OutsideChanges


def models() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = GPT2Config(
        n_layer=12, n_embd=64, n_head=4, vocab_size=1000, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return {
        "mlp": (nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)), torch.randn(32, 16)),
        "gpt2-12-layer": (GPT2LMHeadModel(config), torch.randint(0, 1000, (8, 32))),
    }


def per_call(fn, rounds: int) -> float:
    start = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - start) / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{'model':<16}{'modules':>8}{'params':>8}{'check (us)':>12}{'step (ms)':>11}{'share':>8}")
    for name, (model, x) in models().items():
        follower = copy.deepcopy(model)
        outside = OutsideChanges()
        outside.watch(model, [model, follower])
        check = per_call(lambda: (outside.replay(), outside.after_run()), args.rounds)
        optimizer = torch.optim.AdamW(model.parameters())

        def step() -> None:
            out = model(x)
            loss = (out.logits if hasattr(out, "logits") else out).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        step_time = per_call(step, max(5, args.rounds // 200))
        modules = sum(1 for _ in model.modules())
        params = sum(1 for _ in model.parameters())
        print(f"{name:<16}{modules:>8}{params:>8}{check * 1e6:>12.1f}{step_time * 1e3:>11.2f}{check / step_time:>8.2%}")


if __name__ == "__main__":
    main()
