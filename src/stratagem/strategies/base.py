"""The strategy base class: the vocabulary every strategy shares.

A strategy decides where a model's replicas live and how their gradients are combined;
the user's step function stays the same under every strategy:

    strategy = sg.MirroredStrategy()
    model, optimizer = strategy.distribute(Net(), torch.optim.SGD(...))
    for x, y in strategy.distribute_dataset(loader):      # the loader yields GLOBAL batches
        losses = strategy.run(train_step, args=(x, y))
        print(strategy.reduce("mean", losses))

Subclasses implement `local_devices`, `distribute`, `run` and `explain`; `fit`, `evaluate`, the
command line and the benchmarks use only the members declared here (the fit steps, the input
pipeline and its sharding, the cluster, the distributed model, `close`), each with a default that
holds for a strategy of one process whose replicas run in lockstep. A strategy that spans
processes overrides `cluster`, `input_pipeline`, `shard_input` and the three members that `reduce`,
`gather` and `step` call (`cross_worker_sum`, `gather_across_workers`, `distribute_step_inputs`); one
that runs its steps its own way (the parameter server) overrides `run_fit_steps`, `prepare_fit_steps`
and `is_synchronous`.
"""

from __future__ import annotations

import abc
import builtins
import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stratagem.data.batch_dims import BatchDims, check_batch_dim, check_batch_dims
from stratagem.data.batches import check_iterable, check_shard_policy, distribute_batch
from stratagem.data.distributed_dataset import DistributedDataset
from stratagem.data.split import InputContext
from stratagem.errors import InputError
from stratagem.strategies.distribute_checks import check_optimizer_matches, check_scaler
from stratagem.strategies.explain import Explanation
from stratagem.strategies.gather import gather_values
from stratagem.strategies.lockstep import OnStep, StepFn, run_in_lockstep
from stratagem.strategies.lr_schedulers import DistributedScheduler
from stratagem.strategies.replica_context import current_replica_context
from stratagem.strategies.steps import check_returns, make_step
from stratagem.values import PerReplica, ReduceOp, flatten, map_structure

if TYPE_CHECKING:
    from stratagem.cluster import Cluster
    from stratagem.strategies.state_shards import StateShards


class Strategy(abc.ABC):
    """Base class of every stratagem strategy (tf.distribute's `tf.distribute.Strategy`)."""

    # ---- what a subclass provides -------------------------------------------------------------
    @property
    @abc.abstractmethod
    def local_devices(self) -> list[torch.device]:
        """The physical torch device of each replica of this process, in replica order, as a new list: what
        `fit`, the command line, `gather`, `reduce` and the cut of each batch read."""

    @abc.abstractmethod
    def distribute(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Places `model` (and `optimizer`) for this strategy; returns `(model, optimizer)`,
        or the model alone when no optimizer is given."""

    @abc.abstractmethod
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """Runs `fn(*args, **kwargs)` once per replica; `PerReplica` arguments give each replica its own value."""

    @abc.abstractmethod
    def explain(self) -> Explanation:
        """Where this strategy runs and why."""

    _model: Any = None
    """The model `distribute` returned (None before it ran); set by each strategy's `distribute`."""

    # ---- what fit, evaluate, the command line and the benchmarks read ---------------------------
    @property
    def cluster(self) -> Cluster | None:
        """The cluster this strategy's processes form; None for a strategy of one process."""
        return None

    @property
    def distributed_model(self) -> nn.Module | None:
        """The model `distribute` returned (the first one, where a strategy distributes several), or None before."""
        return self._model

    @property
    def is_synchronous(self) -> bool:
        """True when every replica takes part in each update (False: the parameter server's asynchronous steps)."""
        return True

    @property
    def holds_whole_state(self) -> bool:
        """True when each process's model and optimizer hold whole tensors, as `BackupAndRestore` saves them
        (False: the state is sharded across processes, which a backup of the chief's state would not hold)."""
        return True

    def state_shards(self) -> StateShards | None:
        """How this strategy saves and loads a state sharded across processes (`strategies.state_shards`), or
        None when every process holds the whole model and optimizer and the chief's copy is the whole state."""
        return None

    def input_pipeline(self) -> tuple[int, int]:
        """(number of input pipelines, this process's pipeline id): one pipeline per worker process."""
        return 1, 0

    def shard_input(self, data: Any, *, note: bool = True) -> Any:
        """The part of `data` this process reads (all of it in one process), cut before `data` is wrapped;
        `note`: record the choice for `explain()` ("input sharding")."""
        return data

    def prepare_fit_steps(self, steps: Mapping[str, StepFn], model: Any) -> None:
        """`fit`'s step functions by role (``{"train": ..., "eval": ...}``), on every task, before the first
        step: nothing to do where the steps run in this process."""

    def run_fit_steps(self, step_fn: StepFn, batches: Iterable[Any], on_step: OnStep) -> None:
        """`fit`'s and `evaluate`'s step loop: `step_fn(inputs, targets)` on every replica for each GLOBAL
        batch, `on_step(state, num_examples)` once per batch with the state summed over every replica.

        The default runs the replicas in lockstep (`strategies/lockstep.py`, whose docstring gives the
        contract an override keeps); the parameter server schedules each step on a worker instead.
        """
        run_in_lockstep(self, step_fn, batches, on_step)

    # ---- what a strategy of several processes overrides -------------------------------------------
    def cross_worker_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over every worker process, on every worker: what `reduce` sums with. Here, in one
        process, `tensor` itself; a strategy of several processes sums through its worker group."""
        return tensor

    def gather_across_workers(self, items: list[Any]) -> list[Any]:
        """Every worker's `items` (its replicas' contributions to a `gather`), joined in rank order, on every
        worker. Here, in one process, `items` itself."""
        return items

    def distribute_step_inputs(self, inputs: Any) -> Any:
        """The arguments a `step` function was called with (a GLOBAL batch), cut among this process's replicas:
        `PerReplica` leaves. A strategy of several processes first takes its worker's part of the batch."""
        if not any(isinstance(leaf, torch.Tensor) for leaf in flatten(inputs)):
            return inputs  # no batch to cut: every replica gets the arguments as they are
        return distribute_batch(inputs, self.local_devices)

    def barrier(self) -> None:
        """Waits until every worker of the job has called `barrier()`: the chief wrote a file, now every worker
        may read it (what a DDP script does with `torch.distributed.barrier()`).

        A strategy of one process is the whole job, so here it returns at once; the strategies of several
        processes wait, within their `timeout`, and their error names the workers that did not arrive.
        """

    def close(self) -> None:
        """Releases what this strategy holds (replica threads, process groups, servers); every strategy that
        holds something overrides it, so here there is nothing to release."""

    # ---- shared vocabulary --------------------------------------------------------------------
    def scope(self) -> contextlib.AbstractContextManager[None]:
        """TensorFlow's `strategy.scope()`: build the model inside it, so that one script runs under every strategy.

        Here the model is built as usual (every replica is made from the whole model). `ShardedStrategy` overrides
        it: a model built inside is never whole in one process, its shards filled with one device's values.

        Example:
            >>> with strategy.scope():
            ...     model = Net()
            >>> model, optimizer = strategy.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
        """
        return contextlib.nullcontext()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """A context in which backward passes only accumulate gradients (see `MirroredStrategy.no_sync`).

        Here it changes nothing: this strategy's backward combines nothing that could be skipped, or
        combining each micro-batch is already what it does, so accumulation gives one device's sum either way.
        """
        return contextlib.nullcontext()

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas take part in each step, across every worker."""
        return len(self.local_devices)

    def distribute_dataset(
        self, dataset: Iterable[Any], shard: str = "auto", *, batch_dim: int = 0
    ) -> DistributedDataset:
        """Splits each GLOBAL batch that `dataset` yields among the replicas.

        `shard` says how the input is divided among the workers of a job of several processes ("auto",
        "data", "file" or "off": see `MultiWorkerMirroredStrategy.distribute_dataset`). A strategy of one
        process is one worker, which reads all of its input, so here every policy means the same: a script
        that passes `shard=` runs under every strategy.

        Each batch (a tensor, or any nest of tensors sharing their first dimension: tuples, lists,
        named tuples, dicts and other Mappings such as Hugging Face's BatchEncoding, dataclasses)
        is cut into contiguous slices whose sizes differ by at most one; a replica whose slice is
        empty still takes part in the step, with weight zero. `batch_dim` is the dimension of every
        tensor that counts examples (1 for `(seq, batch)` batches); tensors that disagree along it are
        refused, naming the tensor.

        Example:
            >>> loader = DataLoader(data, batch_size=256)          # 256 = the global batch
            >>> for x, y in strategy.distribute_dataset(loader):
            ...     strategy.run(train_step, args=(x, y))
        """
        check_iterable(dataset, "distribute_dataset")
        check_shard_policy(shard)
        check_batch_dim(batch_dim)
        return DistributedDataset(lambda: self.local_devices, dataset, batch_dim=batch_dim)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]]
    ) -> DistributedDataset:
        """Builds the input of each input pipeline with `dataset_fn(input_context)`.

        The iterable it returns yields PER-REPLICA batches: each local replica takes the next one.

        Example:
            >>> def dataset_fn(ctx):
            ...     return DataLoader(data, batch_size=ctx.get_per_replica_batch_size(256))
            >>> dataset = strategy.distribute_datasets_from_function(dataset_fn)
        """
        if not callable(dataset_fn):
            raise InputError(
                "distribute_datasets_from_function needs a function of an InputContext. "
                f"Received: {type(dataset_fn).__name__}. For a loader of global batches use distribute_dataset."
            )
        num_pipelines, pipeline_id = self.input_pipeline()
        ctx = InputContext(
            num_input_pipelines=num_pipelines,
            input_pipeline_id=pipeline_id,
            num_replicas_in_sync=self.num_replicas_in_sync,
        )
        dataset = dataset_fn(ctx)
        check_iterable(dataset, "the function given to distribute_datasets_from_function")
        return DistributedDataset(lambda: self.local_devices, dataset, per_replica=True)

    def distribute_scheduler(self, scheduler: Any) -> Any:
        """`scheduler` (a torch LR scheduler, built on the optimizer given to `distribute` or on the one it
        returned) as an object of stratagem's that steps it once per global step, whether `step()` is called
        in the step function or after `run`. Step what this returns; the scheduler itself is left as it is.
        A scheduler stepped in the step function and not handed over is refused there: every replica would
        step it. Here, where one thread runs the step function, it steps the scheduler as it is.

        Example:
            >>> model, optimizer = strategy.distribute(model, optimizer)
            >>> scheduler = strategy.distribute_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, 2))
        """
        # A method of its own rather than a third argument of distribute: distribute returns one pair for every
        # strategy (fit, ports and type checkers rely on it), and a scheduler built on the optimizer distribute
        # returns can only be handed over after that call anyway.
        return DistributedScheduler(scheduler, None)

    def distribute_scaler(self, scaler: torch.amp.GradScaler) -> Any:
        """A loss scaler for this strategy's step function: `scaler` itself where one thread runs the step,
        else one scaler per local replica behind one object (see `stratagem.strategies.data_parallel.amp`). Every replica
        and worker keeps the same scale, and an inf/NaN in any replica skips the step on all of them.

        Example:
            >>> scaler = strategy.distribute_scaler(torch.amp.GradScaler("cuda"))
        """
        check_scaler(scaler)
        return scaler  # one thread runs the step: torch's scaler as it is

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The values of the local replicas, as a tuple (one element for a plain value)."""
        if isinstance(value, PerReplica):
            return tuple(value.values)
        return (value,)

    def reduce(self, op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combines per-replica values into one: SUM or MEAN across replicas.

        MEAN weights each replica by its share of the global batch when `value` came from a
        step over a distributed batch, so the mean of per-replica mean losses is the mean loss
        over the global batch (replicas with an empty slice count for nothing). With `axis=0`
        the values are also reduced over their first (batch) dimension, MEAN dividing by the
        true global number of examples. Nests (tuples, dicts, dataclasses such as a model's output
        object, any Mapping) are reduced leaf by leaf into the same structure; None leaves stay None.
        """
        op = ReduceOp.parse(op)
        if axis not in (None, 0):
            raise InputError(f"reduce supports axis=None or axis=0. Received: axis={axis!r}.")
        with torch.no_grad():  # a reduced value is a report, not part of the graph
            return map_structure(lambda leaf: self._reduce_leaf(op, leaf, axis), value)

    def gather(self, value: Any, axis: int = 0) -> Any:
        """Every replica's values, of every worker, concatenated in global batch order.

        Tensors are concatenated along `axis` (0-dim tensors stacked); lists of Python objects are
        joined into one list; other objects give a list with one entry per replica. Nests (dicts,
        tuples) are gathered leaf by leaf. A `PerReplica` value counts once per replica, any other
        value once per worker. Every worker receives the whole result (call it on every worker).

        Example:
            >>> preds = strategy.run(lambda x: model(x).argmax(1), args=(x,))
            >>> strategy.gather(preds)               # the predictions of the whole global batch, in order
        """
        if current_replica_context() is not None:
            raise InputError(
                "gather combines the values of every replica, so it runs outside strategy.run, on what run "
                "returned. Received: a call from inside a replica's step function. Return the value from the "
                "step function and gather the result."
            )
        return gather_values(value, axis, len(self.local_devices), self.gather_across_workers, self._reduce_device())

    def step(self, fn: Callable[..., Any] | None = None, *, returns: str = "mean", batch_dims: BatchDims = None) -> Any:
        """Makes `fn` a step function called with the GLOBAL batch that runs once per replica.

        The wrapper cuts every tensor argument (a global batch: first dimension = examples) among
        the replicas, of this worker only under MultiWorkerMirrored, runs `fn` on each with `run`,
        and combines the results as one device would have returned them for the whole batch:
        ``returns="mean"`` averages over the global batch (each replica weighted by its share),
        ``"sum"`` sums, ``"gather"`` concatenates in batch order (`gather`), ``"per_replica"``
        gives `run`'s `PerReplica` values. Use it as a decorator on the body of an existing loop,
        or wrap a model to predict on global batches.

        `batch_dims` names the dimension that counts examples where it is not the first: an int for every
        tensor argument, or a dict of argument names (the function's parameters) to ints, the others
        keeping 0. Arguments whose sizes along their batch dimensions differ are refused, naming the argument,
        before anything is cut. A `PerReplica` argument (a result of `returns="per_replica"` handed back, such
        as a recurrent state) reaches each replica as its own value, uncut.

        Example:
            >>> @strategy.step
            ... def train_step(data, target):
            ...     optimizer.zero_grad()
            ...     loss = F.nll_loss(model(data), target)
            ...     loss.backward()
            ...     optimizer.step()
            ...     return loss
            >>> for data, target in loader:                   # global batches, as on one device
            ...     loss = train_step(data, target)           # the mean loss over the global batch
            >>> predict = strategy.step(model, returns="gather")
            >>> logits = predict(images)                      # every example's logits, in order
            >>> @strategy.step(batch_dims=1, returns="per_replica")   # (seq, batch) inputs, an LSTM's state
            ... def lm_step(data, targets, hidden):
            ...     output, hidden = model(data, hidden)
            ...     ...
            ...     return loss, hidden                      # the state stays with its replica's columns
        """
        if fn is None:
            check_returns(returns)
            check_batch_dims(batch_dims, where="step()")
            return lambda function: make_step(self, function, returns, self.distribute_step_inputs, batch_dims)
        return make_step(self, fn, returns, self.distribute_step_inputs, batch_dims)

    @property
    def is_chief(self) -> bool:
        """True in the process that writes checkpoints and reports: the only one, or worker 0 of a cluster."""
        return True

    def print(self, *values: Any, **options: Any) -> None:
        """`print(*values, **options)` in the chief only, so a launched run reports once, not once per worker.

        Library code never prints (only stratagem's command line does); this helper is the one
        exception, because the user calls it explicitly in place of their own `print`. Output is
        flushed, so it reaches `stratagem launch`'s prefixed output as it is written.
        """
        if self.is_chief:
            options.setdefault("flush", True)
            builtins.print(*values, **options)

    def _check_distribute_args(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, held: Any) -> None:
        """The checks a strategy makes before `distribute` copies anything (`held`: the model it already holds)."""
        if not isinstance(model, nn.Module):
            raise InputError(f"distribute() needs a torch.nn.Module. Received: {type(model).__name__}.")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise InputError(
                f"distribute() needs a torch.optim.Optimizer or None. Received: {type(optimizer).__name__}."
            )
        if held is not None:
            raise InputError(
                f"This strategy already holds a distributed model; {type(self).__name__} distributes one model. "
                f"Received: a second distribute() of a {type(model).__name__}. Make one nn.Module that holds both "
                "models and distribute it once, or use a data-parallel strategy (OneDevice, Mirrored, "
                "CentralStorage, MultiWorkerMirrored, Sharded), which distributes every model of a step."
            )
        if optimizer is not None:
            check_optimizer_matches(model, optimizer)

    def _reduce_device(self) -> torch.device:
        return self.local_devices[0]

    def _reduce_leaf(self, op: ReduceOp, value: Any, axis: int | None) -> torch.Tensor | None:
        if value is None or (isinstance(value, PerReplica) and all(v is None for v in value.values)):
            return None  # an output field the model left unset (a ModelOutput's optional loss, say)
        device = self._reduce_device()
        if isinstance(value, PerReplica):
            values = list(value.values)
            sizes = value.weights if value.weights is not None else value.batch_sizes
        else:
            # A value that is not per-replica is the same on every replica (tf.distribute's rule).
            values, sizes = [value] * len(self.local_devices), None
        tensors = [torch.as_tensor(v).to(device) for v in values]
        if axis == 0:
            total = self.cross_worker_sum(torch.stack([t.sum(dim=0) for t in tensors]).sum(dim=0))
            if op is ReduceOp.SUM:
                return total
            count = self.cross_worker_sum(torch.tensor(float(sum(t.shape[0] for t in tensors)), device=device))
            return total / count
        if op is ReduceOp.SUM:
            return self.cross_worker_sum(torch.stack(tensors).sum(dim=0))
        if sizes is not None:
            # Replicas of weight zero count for nothing (an empty slice's mean may be NaN); a worker whose
            # replicas all weigh zero still joins the sums across workers, with zeros.
            kept = [(t, n) for t, n in zip(tensors, sizes) if n > 0]
            as_float = [t.to(torch.float64 if t.dtype == torch.float64 else torch.float32) for t in tensors]
            weighted = (
                torch.stack([f * n for f, (t, n) in zip(as_float, zip(tensors, sizes)) if n > 0]).sum(dim=0)
                if kept
                else torch.zeros_like(as_float[0])
            )
            count = torch.tensor(float(sum(sizes)), device=device)
        else:
            weighted = torch.stack(
                [t.to(torch.float64 if t.dtype == torch.float64 else torch.float32) for t in tensors]
            ).sum(dim=0)
            count = torch.tensor(float(len(tensors)), device=device)
        return self.cross_worker_sum(weighted) / self.cross_worker_sum(count)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={[str(d) for d in self.local_devices]})"
