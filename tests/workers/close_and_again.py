"""One worker of tests/test_close_frees_the_port.py, run under `stratagem launch`: trains under a strategy,
closes it while keeping the trained model (under ShardedStrategy its FSDP2 state keeps the process group),
checks on the chief that the rendezvous port is free, then trains again under a second strategy built in the
same process at the same cluster address. Settings arrive as environment variables:

CA_KIND   "sharded" (ShardedStrategy) or "mirrored" (MultiWorkerMirroredStrategy)
Prints one JSON line: {"rank", "port_free" (the chief only, else null), "addresses", "losses": [first, second]}.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import torch
from torch import nn

import stratagem as sg

GLOBAL_BATCH = 8
STEPS = 2


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(GLOBAL_BATCH, 4, generator=g), torch.randn(GLOBAL_BATCH, 2, generator=g)) for _ in range(STEPS)
    ]


def can_listen(host: str, port: int) -> bool:
    """Whether a new listener can take `host:port` (as the next chief's store would: with SO_REUSEADDR, so that
    connections of the old store still in TIME_WAIT do not count, only a listener does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen()
        except OSError:
            return False
    return True


def train(kind: str) -> tuple[nn.Module, list[float], tuple[str, int], int]:
    """Trains STEPS steps under a new strategy of `kind`, closes it; the trained (distributed) model, the mean
    loss of each step, the chief's address and this rank."""
    strategy: Any = sg.ShardedStrategy(timeout=60) if kind == "sharded" else sg.MultiWorkerMirroredStrategy(timeout=60)
    net = model()
    trained, optimizer = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ((trained(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    losses = [
        float(strategy.reduce("mean", strategy.run(step, args=b))) for b in strategy.distribute_dataset(batches())
    ]
    cluster = strategy.cluster
    strategy.close()
    return trained, losses, (cluster.master_addr, cluster.master_port), cluster.rank


def main() -> None:
    torch.set_num_threads(1)
    kind = os.environ["CA_KIND"]
    first, first_losses, address, rank = train(kind)  # `first` stays alive to the end, its process group with it
    port_free = can_listen(*address) if rank == 0 else None
    _second, second_losses, again, _ = train(kind)
    out = {"rank": rank, "port_free": port_free, "addresses": [list(address), list(again)]}
    print(json.dumps({**out, "losses": [first_losses, second_losses], "kept": type(first).__name__}), flush=True)


if __name__ == "__main__":
    main()
