"""ParameterServerStrategy: variables on parameter servers, steps scheduled on workers, asynchronously.

    stratagem launch --workers 2 --ps 1 examples/parameter_server.py

Every task runs this same script: a parameter server serves from the strategy's constructor, a
worker from its first `coordinator.schedule`, and the chief (worker 0 under `stratagem launch`)
schedules the steps. `sg.fit` does all of this for you (examples/fit.py); here is the loop by hand.
"""

import torch
import torch.nn.functional as F
from toy import make_loader, make_net

import stratagem as sg

strategy = sg.ParameterServerStrategy(partitioner=sg.FixedShardsPartitioner(2))   # each weight in 2 shards
net = make_net()
model, optimizer = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
coordinator = sg.ClusterCoordinator(strategy)


def dataset_fn():                      # called on each worker, which reads its own data
    while True:
        yield from make_loader()


per_worker = iter(coordinator.create_per_worker_dataset(dataset_fn))


def train_step(iterator):              # module level: each worker finds it by name in its copy of the script
    x, y = next(iterator)
    loss = F.cross_entropy(model(x), y)  # the worker's replica pulls the current parameters first
    loss.backward()
    optimizer.step()                   # pushes the gradients; the parameter servers apply the update
    optimizer.zero_grad()
    return loss


for epoch in range(1, 6):
    losses = [coordinator.schedule(train_step, args=(per_worker,)) for _ in range(8)]   # never blocks
    coordinator.join()                 # re-raises the first error of any step
    print(f"epoch {epoch}: loss {sum(loss.fetch().item() for loss in losses) / len(losses):.4f}")
strategy.shutdown()                    # ends the job: workers and parameter servers exit
