"""CentralStorageStrategy: the parameters and the optimizer state live once, on one device,
while every local device computes on its slice of the batch.

    python examples/central_storage.py

Use it when the optimizer state would not fit on every GPU (Adam keeps two more copies of the
parameters): here it lives once, on the CPU or on the only GPU.
"""

import torch
import torch.nn.functional as F
from toy import make_loader, make_net

import stratagem as sg

strategy = sg.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cpu")
print(strategy.explain())              # where the parameters live, what is copied, who applies the update

net = make_net()
model, optimizer = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))


def train_step(x, y):                  # the script is MirroredStrategy's, unchanged
    loss = F.cross_entropy(model(x), y)
    loss.backward()                    # returns with the weighted sum of the gradients on every replica
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()                   # applied once, on the central device
    optimizer.zero_grad()
    return loss


for epoch in range(1, 6):
    losses = [strategy.reduce("mean", strategy.run(train_step, args=batch)).item()
              for batch in strategy.distribute_dataset(make_loader())]
    print(f"epoch {epoch}: loss {sum(losses) / len(losses):.4f}")
strategy.close()
