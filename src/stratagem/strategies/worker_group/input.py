"""The input of a strategy of one process per worker: each step's batches for this worker's replicas, and the
agreement across workers that every one of them has a batch (so they all stop at the same step).

With `shard="data"` every worker iterates the same global batches (or, cut at the index level by
`data/worker_shards.py`, only its own part of each, with the global size carried along) and keeps
the part of its replicas (`WorkerRange`: several local ones under MultiWorkerMirrored, one under Sharded, its
model group's under TensorParallel, where the workers of a group keep the same part); with `shard="file"` or
`"off"`, or a DataLoader with a DistributedSampler (`data/distributed_sampler.py`), each worker's loader
already yields its part. When the loaders know their length the workers agree on the number of steps once per
pass; otherwise they agree at every step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from stratagem.cluster.worker_group import WorkerGroup
from stratagem.data.batches import stack_batch
from stratagem.data.distributed_sampler import WorkerBatch, is_per_worker
from stratagem.data.resume import batches_left
from stratagem.data.split import batch_size_of, split_batch, split_sizes
from stratagem.data.worker_shards import WorkerPart, WorkerRange
from stratagem.diagnose import PlacementDecision
from stratagem.errors import InputError
from stratagem.strategies.worker_group.agreement import BatchAgreement
from stratagem.strategies.worker_group.stragglers import StepTimes
from stratagem.trace import Recorder
from stratagem.values import PerReplica, flatten, map_structure

logger = logging.getLogger(__name__)


class InputSharding:
    """The input-sharding part: how this worker reads its part of the input, as last noted ("input sharding")."""

    def __init__(self) -> None:
        self._decision: PlacementDecision | None = None

    @property
    def choice(self) -> str | None:
        return None if self._decision is None else self._decision.choice

    def note(self, choice: str, why: str) -> None:
        """The way the input that is read now is sharded (each `distribute_dataset` or `fit` says it again)."""
        self._decision = PlacementDecision(subject="input sharding", choice=choice, reason=why)

    def decisions(self) -> list[PlacementDecision]:
        return [] if self._decision is None else [self._decision]

    def details(self) -> dict[str, str]:
        return {}


class WorkerBatches:
    """This worker's part of each global batch, cut among its local replicas.

    `group`: the worker group (local devices, collectives); `replicas`: which of the replicas among which a global
    batch is split (sizes differing by at most one) are this worker's (an int n: n replicas, `group.rank`'s local
    ones); `leads`: whether this worker counts its own part (shard="off") in the step's global size, False on
    every worker of a model group but its first, which read the same part; `agreement`: notes each batch's fingerprint, compared across workers with the step's gradient sum;
    `times`: counts the time spent fetching and cutting batches as the input phase of the step;
    `recorder`: records it as an input span while it is on (`stratagem.trace`).
    """

    def __init__(
        self,
        group: WorkerGroup,
        replicas: WorkerRange | int,
        agreement: BatchAgreement | None = None,
        times: StepTimes | None = None,
        recorder: Recorder | None = None,
        *,
        leads: bool = True,
    ) -> None:
        if isinstance(replicas, int):
            local = len(group.local_devices)
            replicas = WorkerRange(replicas, group.rank * local, local)
        self.group = group
        self.replicas = replicas
        self.num_replicas_in_sync = replicas.num_replicas
        self.leads = leads
        self.agreement = agreement
        self.times = times
        self.recorder = recorder

    def input_started(self) -> int | None:
        """The trace's time now, when it records (else None): the start of a step's input span."""
        recorder = self.recorder
        return recorder.now() if recorder is not None and recorder.on else None

    def input_ended(self, started: int | None, step: int) -> None:
        """The input span of the `step`-th batch (from 0) of this pass, started at `started`."""
        recorder = self.recorder
        if started is not None and recorder is not None and recorder.on:
            recorder.span("input", f"input {step}", started, recorder.now(), args={"batch": step})

    def note_input_time(self, since: float, minus: float = 0.0) -> None:
        """Time from `since` (time.perf_counter) to now, less `minus` seconds of collectives, was spent on input."""
        if self.times is not None:
            self.times.input_(time.perf_counter() - since - minus)
            self.times.communication_(minus)

    def global_sizes(self, global_size: int) -> list[int]:
        """The sizes of this worker's replicas' slices of a global batch of `global_size` examples."""
        first, count = self.replicas.first, self.replicas.count
        return split_sizes(global_size, self.num_replicas_in_sync)[first : first + count]

    def local_part(self, batch: Any, global_size: int, step: int, *, own: bool = False) -> Any:
        """The per-replica batches of this worker at `step`: from a part cut at the index level (`WorkerPart`),
        from this worker's own batch (`WorkerBatch`, or `own=True`: shard="file" or "off"), else its
        contiguous slice of the global `batch`."""
        devices = self.group.local_devices
        if self.agreement is not None:
            self._note(batch, global_size, own)
        if isinstance(batch, WorkerPart):
            local_sizes = self.global_sizes(global_size)
            have = batch_size_of(batch.batch)
            if have != sum(local_sizes):
                raise InputError(
                    f"Batch {step}: this worker's part of a global batch of {global_size} examples should hold "
                    f"{sum(local_sizes)} of them. Received: {have}. Keep the collate_fn from adding or dropping examples."
                )
            pieces = split_batch(batch.batch, local_sizes, devices)
        elif own or isinstance(batch, WorkerBatch):
            mine = batch.batch if isinstance(batch, WorkerBatch) else batch
            pieces = split_batch(mine, split_sizes(batch_size_of(mine), len(devices)), devices)
        else:
            local_sizes = self.global_sizes(global_size)
            start = self.replicas.bounds(global_size)[0]
            mine = map_structure(
                lambda t: t[start : start + sum(local_sizes)] if isinstance(t, torch.Tensor) else t, batch
            )
            pieces = split_batch(mine, local_sizes, devices)
        stacked = stack_batch(pieces)
        return map_structure(lambda v: _with_global(v, global_size), stacked)

    def _note(self, batch: Any, global_size: int, own: bool) -> None:
        assert self.agreement is not None  # the caller checked
        if isinstance(batch, WorkerPart):
            self.agreement.note_indices(batch.indices_digest, global_size, batch.checked_example)
        elif own or isinstance(batch, WorkerBatch):
            self.agreement.note_own_part()
        else:
            self.agreement.note_global_batch(batch, global_size)

    def step_inputs(self, inputs: Any, step: int) -> Any:
        """This worker's part of the global batch handed to a `step` function, cut among its replicas.

        Every worker calls the step with the same global batch (the same loader, seeded alike), as
        `distribute_dataset(shard="data")` assumes; inputs without a tensor are handed on as they are.
        """
        if not any(isinstance(leaf, torch.Tensor) for leaf in flatten(inputs)):
            return inputs
        size = batch_size_of(inputs)
        if size == 0:
            raise InputError(
                "The global batch given to the step function holds no examples. Received: 0 examples. "
                "Skip empty batches before calling it."
            )
        return self.local_part(inputs, size, step)


class MultiWorkerDataset:
    """Per-step batches for this worker's replicas, with an end-of-data agreement across workers."""

    def __init__(
        self,
        batches: WorkerBatches,
        dataset: Iterable[Any],
        shard: str,
        on_first_batch: Callable[[bool, Any], None] | None = None,
    ) -> None:
        self._batches = batches
        self._group = batches.group
        self._dataset = dataset
        self._shard = shard
        self.unused_examples = 0
        """Examples this worker had fetched but did not train on because another worker ran out."""
        self.steps = 0
        self._on_first_batch = on_first_batch
        self._agreeing = 0.0

    def __iter__(self) -> Iterator[Any]:
        # A loader already cut per worker (a DistributedSampler's) knows its length but not the others' batch
        # sizes, so the workers sum them at every step.
        steps = self._agreed_steps() if self._shard == "data" and not is_per_worker(self._dataset) else None
        if steps is not None:
            yield from self._iterate_agreed(steps)
            return
        cw = self._group.cross_worker
        iterator = iter(self._dataset)
        pending, agreement, works = self._fetch(iterator, 0)
        step = 0
        while True:
            traced = self._batches.input_started()
            waited = time.perf_counter()
            cw.wait(works, what="end-of-data agreement", step=step)
            waited = time.perf_counter() - waited
            have, total = int(agreement[0]), int(agreement[1])
            cw.check()  # under NCCL the read above waited for the GPU: not a value from an aborted collective
            if have < cw.world_size:
                if pending is not None:
                    self.unused_examples = self._unused(pending)
                    logger.warning(
                        "%s stops after %d steps because %d of %d workers ran out of data; %d example(s) this worker "
                        "had fetched were left unused.",
                        cw.task_name,
                        step,
                        cw.world_size - have,
                        cw.world_size,
                        self.unused_examples,
                    )
                self.steps = step
                return
            current = pending
            since = time.perf_counter() - waited
            # Fetch and agree on the next step now: over Gloo the agreement overlaps this step's compute; through
            # shared memory it is done here, at once, since the workers left the last step together.
            pending, agreement, works = self._fetch(iterator, step + 1)
            part = self._distribute(current, total, step)
            self._batches.note_input_time(since, waited + self._agreeing)
            self._batches.input_ended(traced, step)
            yield part
            step += 1

    def _agreed_steps(self) -> int | None:
        """When every worker's loader knows its length: the number of steps of this pass, agreed once.

        The per-step agreement reads a collective's result on the host at every step, which makes the CPU
        wait for the GPU (NCCL) before it can queue the next step. With shard="data" every worker iterates
        the same global batches, so knowing the lengths is enough: one collective per pass, and each
        step's global batch size is the batch's own. None (some loader has no len()): agree per step.
        """
        cw = self._group.cross_worker
        left = batches_left(self._dataset)
        mine = -1 if left is None else left
        device = self._group.collective_device
        lengths = torch.zeros(cw.world_size, dtype=torch.int64, device=device)
        lengths[cw.rank] = mine + 1  # 0: this worker's loader has no length
        cw.all_reduce_([lengths], what="agreement on the number of steps", step=0)
        known = [int(n) - 1 for n in lengths.tolist()]  # the one host read of the pass
        cw.check()
        if min(known) < 0:
            return None
        steps = min(known)
        if mine > steps:
            logger.warning(
                "%s stops after %d steps because another worker's loader has only %d batches; %d batch(es) "
                "of this worker's loader are left unused.",
                cw.task_name,
                steps,
                steps,
                mine - steps,
            )
        return steps

    def _iterate_agreed(self, steps: int) -> Iterator[Any]:
        cw = self._group.cross_worker
        iterator = iter(self._dataset)
        for step in range(steps):
            traced = self._batches.input_started()
            since = time.perf_counter()
            try:
                batch = next(iterator)
                size = _global_size_of(batch)
            except StopIteration:
                raise InputError(
                    f"{cw.task_name}'s loader stopped after {step} batches although its len() is {steps} or more. "
                    "Received: a loader whose length is wrong. Give it a correct __len__, or none (the workers then "
                    "agree at every step)."
                ) from None
            except InputError as error:
                raise InputError(f"Batch {step} of the dataset cannot be distributed: {error}") from None
            if size == 0:
                raise InputError(f"Batch {step} of the dataset holds no examples. Drop empty batches from the input.")
            part = self._distribute(batch, size, step)
            self._batches.note_input_time(since)
            self._batches.input_ended(traced, step)
            yield part
            self.steps = step + 1
        self.steps = steps

    def _fetch(self, iterator: Iterator[Any], step: int) -> tuple[Any, torch.Tensor, list[Any]]:
        try:
            batch = next(iterator)
            size = _global_size_of(batch)
        except StopIteration:
            batch, size = None, 0
        except InputError as error:
            raise InputError(f"Batch {step} of the dataset cannot be distributed: {error}") from None
        if batch is not None and size == 0:
            raise InputError(f"Batch {step} of the dataset holds no examples. Drop empty batches from the input.")
        own = self._shard == "off" or isinstance(batch, WorkerBatch)
        count = (size if self._batches.leads else 0) if own else (size if self._group.rank == 0 else 0)
        agreement = torch.tensor(
            [1 if batch is not None else 0, count], dtype=torch.int64, device=self._group.collective_device
        )
        start = time.perf_counter()
        works = self._group.cross_worker.all_reduce_async([agreement], what="end-of-data agreement", step=step)
        self._agreeing = time.perf_counter() - start  # communication, not input (shared memory sums here)
        return batch, agreement, works

    def _unused(self, batch: Any) -> int:
        if isinstance(batch, (WorkerPart, WorkerBatch)):
            return batch_size_of(batch.batch)
        if self._shard == "off":
            return batch_size_of(batch)
        return sum(self._batches.global_sizes(batch_size_of(batch)))

    def _distribute(self, batch: Any, global_size: int, step: int) -> Any:
        if self._on_first_batch is not None and self._shard == "data":
            # A generator's first batch tells whether it carries parts cut by index (fit's); a worker's own
            # batches were noted when their loader was wrapped.
            if not isinstance(batch, WorkerBatch):
                self._on_first_batch(isinstance(batch, WorkerPart), self._dataset)
            self._on_first_batch = None
        return self._batches.local_part(batch, global_size, step, own=self._shard == "off")


def _global_size_of(batch: Any) -> int:
    """The examples of the step's GLOBAL batch: carried by a part cut at the index level, else the batch's own."""
    if isinstance(batch, WorkerBatch):
        return batch_size_of(batch.batch)  # this worker's own: the workers sum theirs
    return batch.global_size if isinstance(batch, WorkerPart) else batch_size_of(batch)


def _with_global(value: Any, global_size: int) -> Any:

    if isinstance(value, PerReplica):
        return PerReplica(value.values, value.batch_sizes, global_size)
    return value
