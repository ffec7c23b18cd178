"""MirroredStrategy: one replica per device in one process, gradients combined in memory.

    python examples/mirrored.py

On a GPU machine `sg.MirroredStrategy()` takes every visible GPU; on a CPU-only machine the CPU is
split into logical devices, so two replicas run anywhere.
"""

import torch
import torch.nn.functional as F
from toy import make_loader, make_net

import stratagem as sg

strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
print(strategy.explain())              # which devices, why, and how gradients are combined

net = make_net()
model, optimizer = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))


def train_step(x, y):                  # runs once per replica, on its slice of the global batch
    loss = F.cross_entropy(model(x), y)
    loss.backward()                    # returns with the gradients combined across replicas
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # so this clips the global gradient
    optimizer.step()
    optimizer.zero_grad()
    return loss


for epoch in range(1, 6):
    losses = [strategy.reduce("mean", strategy.run(train_step, args=batch)).item()
              for batch in strategy.distribute_dataset(make_loader())]
    print(f"epoch {epoch}: loss {sum(losses) / len(losses):.4f}")
strategy.close()
