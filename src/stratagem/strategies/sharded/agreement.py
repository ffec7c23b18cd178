"""Workers of a sharded job hold the same step and the same global batch, or the job stops before training on it.

The fingerprint is MultiWorkerMirroredStrategy's (`multi_worker.agreement.BatchAgreement`: the step, the global
batch size and a hash of each input, noted as `WorkerBatches` cuts the batch). There it rides the last gradient
all-reduce; here gradients go through FSDP2's reduce-scatters, so the fingerprints travel in one small all-reduce
of their own (`SLOT` bytes per worker, through the worker group's bounded collectives). It is started at the
beginning of each `run` and not waited for there: the step function's forward (and the backward of the last unit)
runs while it travels. The result is waited for and compared before the first gradient reduce-scatter of the step
(`WeightedReduceScatter.before_sum`), so before any sum, and so any update, is made from the batch, and at the end
of `run` for a step without one (a no_sync() micro-batch, an evaluation). A worker handed another batch is still
stopped before any update is made from it; the wait costs nothing once the sum has landed.

Every collective of this group runs in the order it was started, on every worker alike: the check's all-reduce is
started at the same point of every `run` on every worker, before FSDP2's first all-gather of the step, whatever
each worker's `check_batches` (see `StepAgreement.start`).

    >>> agreement = StepAgreement(group, enabled=True)
    >>> batches = WorkerBatches(group, n, agreement.batch)   # notes each batch's fingerprint
    >>> agreement.start(step=1)                              # the all-reduce of every worker's fingerprint
    >>> agreement.finish()                                   # raises InputError naming the step, workers, input
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from stratagem.errors import InputError
from stratagem.strategies.multi_worker.agreement import BatchAgreement

if TYPE_CHECKING:
    from stratagem.cluster.worker_group import WorkerGroup


def check_batches_flag(value: object) -> bool:
    """`check_batches=` as given, refused unless a bool."""
    if not isinstance(value, bool):
        raise InputError(f"check_batches must be True or False. Received: check_batches={value!r}. Pass a bool.")
    return value


@dataclass
class _Pending:
    """A started check: the slots being summed, the all-reduce's handles, its step, whether it compares."""

    slots: torch.Tensor
    works: list[Any]
    step: int
    enabled: bool


class StepAgreement:
    """This worker's `BatchAgreement` and the all-reduce that compares every worker's fingerprint once per step."""

    def __init__(self, group: WorkerGroup, *, enabled: bool) -> None:
        self._group = group
        self.batch = BatchAgreement(
            rank=group.rank, task_names=group.task_names, enabled=enabled, strategy="ShardedStrategy"
        )
        self._pending: _Pending | None = None

    @property
    def enabled(self) -> bool:
        """Whether this worker compares the fingerprints (its `check_batches`)."""
        return self.batch.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self.batch.enabled = check_batches_flag(value)

    def start(self, step: int) -> None:
        """Starts the all-reduce of every worker's fingerprint of `step` (each in its own slot, exact in float32).

        Started with the check off too (the slot sent empty, nothing compared here): every worker makes the same
        collectives in the same order whatever each was given, so a worker whose check is off while others' is on
        is named by them, where a collective made by some workers only would be paired with another one (FSDP2's
        next all-gather) on the others. A check still pending (a step whose end was never reached) is finished
        first, so two are never in flight."""
        self.finish()
        slots = self.batch.slots(step, torch.float32, self._group.collective_device)
        works = self._group.cross_worker.all_reduce_async([slots], what="batch agreement", step=step)
        self._pending = _Pending(slots, works, step, self.batch.enabled)

    def finish(self) -> None:
        """Waits (within the group's timeout) for the started all-reduce, then compares every worker's fingerprint
        with the chief's: raises `InputError` naming the step, the workers and the first input that differs, on
        every worker alike. Nothing when no check is pending, so it may be called at every reduce-scatter."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        cw = self._group.cross_worker
        cw.wait(pending.works, what="batch agreement", step=pending.step)
        summed = pending.slots.tolist()  # a host read: on the device path it waits for the sum (then check())
        cw.check()
        if pending.enabled:
            self.batch.check(summed, pending.step)

    def finish_after_error(self) -> None:
        """After the step function raised: compares if the sum has already landed (a disagreement may be why it
        raised, and is then the error to report), else drops it without waiting, since a worker that is gone
        would make that wait last the whole timeout again."""
        pending = self._pending
        if pending is not None and all(w.is_completed() for w in pending.works):
            self.finish()
        self._pending = None
