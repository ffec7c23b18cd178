"""Workers of a sharded job hold the same step and the same global batch, or the job stops before training on it.

The fingerprint is MultiWorkerMirroredStrategy's (`multi_worker.agreement.BatchAgreement`: the step, the global
batch size and a hash of each input, noted as `WorkerBatches` cuts the batch). There it rides the last gradient
all-reduce; here gradients go through FSDP2's reduce-scatters, so the fingerprints travel in one small all-reduce
of their own (`SLOT` bytes per worker, through the worker group's bounded collectives) at the start of each
`run`, before the step function: a worker handed another batch is stopped before any update is made from it.

    >>> agreement = StepAgreement(group, enabled=True)
    >>> batches = WorkerBatches(group, n, agreement.batch)   # notes each batch's fingerprint
    >>> agreement.check(step=1)                              # raises InputError naming the step, workers, input
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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


class StepAgreement:
    """This worker's `BatchAgreement` and the all-reduce that compares every worker's fingerprint once per step."""

    def __init__(self, group: WorkerGroup, *, enabled: bool) -> None:
        self._group = group
        self.batch = BatchAgreement(
            rank=group.rank, task_names=group.task_names, enabled=enabled, strategy="ShardedStrategy"
        )

    def check(self, step: int) -> None:
        """Every worker's fingerprint of `step`, summed (each in its own slot, exact in float32), then compared
        with the chief's. The all-reduce is made with the check off too (the slot sent empty, nothing compared
        here): every worker makes the same collectives whatever each was given, so a worker whose check is off
        while others' is on is named by them, where a collective made by some workers only would be paired with
        another one (FSDP2's next all-gather) on the others."""
        slots = self.batch.slots(step, torch.float32, self._group.collective_device)
        self._group.cross_worker.all_reduce_([slots], what="batch agreement", step=step)
        self.batch.check(slots.tolist(), step)
