"""Each rank of tests/test_sharded_memory_limit.py: moves itself into its own cgroup v1 memory cgroup limited to its
runtime plus 0.4x the whole model's float32 AdamW training state, then MultiWorkerMirroredStrategy (refused before
training) and ShardedStrategy(stage=3), the model built inside its scope() (trains to the end), on the same model."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

WIDTH, DEPTH = 1536, 24  # 56.6M parameters, 216 MiB in float32; a unit is 9 MiB
BUDGET = 0.4  # of the whole model's training state: parameters, gradients, AdamW's two moments (16 B a parameter)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


def state_bytes() -> int:
    return 16 * DEPTH * (WIDTH * WIDTH + WIDTH)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read())


def enter_cgroup(directory: str) -> int:
    """Moves this process into `directory` and limits it to its usage there now (the runtime, where its charges
    move with it) plus BUDGET of the training state; returns the limit."""
    try:  # the memory already held moves with the process where the kernel still can (removed in Linux 6.x):
        _write(f"{directory}/memory.move_charge_at_immigrate", "3")
    except OSError:
        pass  # else it stays charged where it was, and the limit below counts what the process takes from now on
    _write(f"{directory}/cgroup.procs", str(os.getpid()))
    limit = _read_int(f"{directory}/memory.usage_in_bytes") + int(BUDGET * state_bytes())
    _write(f"{directory}/memory.limit_in_bytes", str(limit))
    return limit


def cluster(rank: int, ports: list[int]) -> dict[str, Any]:
    return {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": rank}}


def limited_case(rank: int, directories: list[str], mw_ports: list[int], sharded_ports: list[int]) -> dict[str, Any]:
    import stratagem as sg

    out: dict[str, Any] = {}
    mirrored = sg.MultiWorkerMirroredStrategy(cluster=cluster(rank, mw_ports), timeout=120)
    import torch.distributed.fsdp  # noqa: F401  (part of the runtime, as the sharded strategy's import)
    import torch.distributed.tensor  # noqa: F401

    out["limit"] = enter_cgroup(directories[rank])
    net = model()
    try:
        mirrored.distribute(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
        out["mirrored"] = "trained"
    except sg.InputError as error:
        out["mirrored"] = str(error)
    mirrored.close()
    del net
    strategy = sg.ShardedStrategy(stage=3, cluster=cluster(rank, sharded_ports), timeout=120)
    # As a user whose model does not fit one worker builds it: never whole in this process (scope.py). Built whole
    # here, the chief's peak sat within 1 MiB of its limit (its store and first reads take ~45 MiB more).
    with strategy.scope():
        net = model()
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    out["plan"] = strategy.memory_plan(net, optimizer).total
    sharded, optimizer = strategy.distribute(net, optimizer)
    del net
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, WIDTH, generator=g), torch.randn(16, WIDTH, generator=g)) for _ in range(3)]

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ((sharded(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    out["steps"] = sum(1 for x, y in strategy.distribute_dataset(data) if strategy.run(step, args=(x, y)) is not None)
    out["peak usage"] = _read_int(f"{directories[rank]}/memory.max_usage_in_bytes")
    out["failcnt"] = _read_int(f"{directories[rank]}/memory.failcnt")
    strategy.close()
    return out
