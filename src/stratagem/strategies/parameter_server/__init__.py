"""Parameter-server training over gRPC: the strategy, its coordinator, partitioners, service and wire format.

    strategy = sg.ParameterServerStrategy()              # TF_CONFIG with ps tasks, or stratagem launch --ps 1
    model, optimizer = strategy.distribute(Net(), torch.optim.Adam(...))
    coordinator = sg.ClusterCoordinator(strategy)
    loss = coordinator.schedule(train_step, args=(iterator,))
    coordinator.join()

How it fits together (each module's docstring has the details):

- ``wire``: a message is a JSON header plus raw tensor bytes (dtype, shape, offset), never pickle;
  it travels as a stream of chunks built straight from tensor memory, and pulls and pushes are
  written straight into parameters and gradient buffers as the chunks arrive. ``header`` checks a
  received header (magic, lengths, form, dtypes, shapes, offsets) before any tensor is built.
- ``transport``: every method is a gRPC stream of bytes with generic handlers (no protoc). A
  server interceptor refuses a call without the cluster token, or with a wrong one, with
  ``UNAUTHENTICATED`` before any of its bytes are read; servers listen on 127.0.0.1 unless told
  otherwise; TLS with certificate and key paths.
- ``partitioners``: tf.distribute's fixed-shards, min-size and max-size rules along dimension 0,
  shards dealt round-robin over the parameter servers.
- ``server``: a parameter server holds shards and applies the user's optimizer class, with its
  hyper-parameters and state, to the shards a push names (``optimizers``: the optimizer travels as
  JSON and is built again without calling its class's ``__init__``); ``variables`` is the client side (one
  call per server for a pull or a push, bucket by bucket as ``layout`` works them out); ``checkpoint``
  puts the shards together into one file and cuts it again for any placement.
- ``functions``: a scheduled function travels as its module and qualified name and is found in the
  worker's own copy of the script (the same script runs on every task); arguments and results are
  tensors, plain JSON values, and references to per-worker iterators. Only an authenticated peer
  gets that far, and nothing it sends is executed except functions the worker's script defines.
- ``worker``: runs scheduled functions; inside one, the distributed model is the worker's replica
  (pulled at its first forward pass) and ``optimizer.step()`` pushes the gradients.
- ``coordinator``: ``schedule`` / ``join`` / ``done`` / ``fetch``, first error re-raised and pending
  work cancelled, functions of a lost worker run again elsewhere, a lost parameter server named.
- ``strategy``: the role of each task, ``distribute``, checkpoints (``save`` / ``restore``).
- ``tasks``: parameter-server and worker tasks serve until the chief ends the job (or fail naming it);
  ``InProcessCluster`` runs them as servers in this process, on 127.0.0.1, for tests and trials.

Known limits: a function may run twice when its worker dies after pushing (at least once, as in
tf.distribute); a restarted worker starts its per-worker dataset from the beginning; an optimizer
whose update looks across a whole tensor (LBFGS) needs placement without a partitioner; learning
rate schedulers on the chief do not reach the parameter servers.
"""

from stratagem.strategies.parameter_server.coordinator import (
    ClusterCoordinator,
    PerWorkerDataset,
    PerWorkerIterator,
    RemoteValue,
)
from stratagem.strategies.parameter_server.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
)
from stratagem.strategies.parameter_server.strategy import (
    InProcessCluster,
    ParameterServerStrategy,
)

__all__ = [
    "ClusterCoordinator",
    "FixedShardsPartitioner",
    "InProcessCluster",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "ParameterServerStrategy",
    "Partitioner",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "RemoteValue",
]
