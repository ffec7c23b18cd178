"""OneDeviceStrategy: the same script on one device, the reference every other strategy matches.

    python examples/one_device.py
"""

import torch
import torch.nn.functional as F
from toy import make_loader, make_net

import stratagem as sg

strategy = sg.OneDeviceStrategy("cuda:0" if torch.cuda.is_available() else "cpu")
net = make_net()
# The optimizer and the clipping of every other example (examples/mirrored.py...), so the runs compare one to one.
model, optimizer = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))


def train_step(x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
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
