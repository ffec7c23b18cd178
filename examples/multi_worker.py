"""MultiWorkerMirroredStrategy: one process per worker, gradients all-reduced across processes.

Run it as a local cluster of two workers (or under torchrun, SLURM, or with TF_CONFIG set):
    stratagem launch --workers 2 examples/multi_worker.py
"""

import torch
import torch.nn.functional as F
from toy import make_loader, make_net

import stratagem as sg

strategy = sg.MultiWorkerMirroredStrategy(timeout=60)   # who am I: TF_CONFIG, torchrun or SLURM variables
chief = strategy.cluster.rank == 0
if chief:
    print(strategy.explain())

net = make_net()                       # the chief's initial parameters are broadcast to every worker
model, optimizer = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))


def train_step(x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()                    # returns with the gradients all-reduced across the workers
    optimizer.step()
    optimizer.zero_grad()
    return loss


for epoch in range(1, 6):
    # Every worker iterates the same global batches and keeps its own part of each (shard="data").
    losses = [strategy.reduce("mean", strategy.run(train_step, args=batch)).item()
              for batch in strategy.distribute_dataset(make_loader())]
    if chief:
        print(f"epoch {epoch}: loss {sum(losses) / len(losses):.4f}")
strategy.close()
