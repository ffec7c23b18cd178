"""OneDeviceStrategy: the same script on one device, the reference every other strategy matches.

    python examples/one_device.py
"""

import torch
import torch.nn.functional as F
from toy import make_loader, make_net

import stratagem as sg

strategy = sg.OneDeviceStrategy("cuda:0" if torch.cuda.is_available() else "cpu")
net = make_net()
model, optimizer = strategy.distribute(net, torch.optim.Adam(net.parameters(), lr=1e-2))


def train_step(x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


for epoch in range(1, 6):
    total = examples = 0
    for x, y in strategy.distribute_dataset(make_loader()):   # moves each batch to the device
        total += strategy.run(train_step, args=(x, y)).item() * len(y)
        examples += len(y)
    print(f"epoch {epoch}: loss {total / examples:.4f}")
strategy.close()
