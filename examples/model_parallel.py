"""ModelParallelStrategy: one model split across devices, for a model too large for one.

    python examples/model_parallel.py

The layers of the Sequential are cut into two stages (on two GPUs: stages=["cuda:0", "cuda:1"]),
and each global batch into four micro-batches that flow through the stages concurrently (GPipe):
stage 1 works on micro-batch m while stage 0 works on m + 1.
"""

import torch
import torch.nn.functional as F
from toy import make_loader, make_net

import stratagem as sg

strategy = sg.ModelParallelStrategy(stages=["cpu:0", "cpu:1"], num_micro_batches=4)
net = make_net()
model, optimizer = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
print(strategy.explain())              # the stage map: modules, parameters and memory per device


def train_step(x, y):                  # the same step function as every other strategy
    loss = F.cross_entropy(model(x), y)
    loss.backward()                    # gradients accumulated over the micro-batches
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    return loss


for epoch in range(1, 6):
    losses = [strategy.reduce("mean", strategy.run(train_step, args=batch)).item()
              for batch in strategy.distribute_dataset(make_loader())]
    print(f"epoch {epoch}: loss {sum(losses) / len(losses):.4f}")
strategy.close()
