"""Workers of a sharded or tensor-parallel job hold the same step and the same global batch, or the job stops before
training on it.

The fingerprint is MultiWorkerMirroredStrategy's (`worker_group.agreement.BatchAgreement`: the step, the global
batch size and a hash of each input, noted as `WorkerBatches` cuts the batch), and, as there, it rides a sum the
step makes anyway: FSDP2's first gradient reduce-scatter of the step (`WeightedReduceScatter`, which puts every
worker's slots beside each rank's chunk, so each rank's part of the sum ends with every worker's fingerprint).
It is compared as soon as that sum lands, before the next unit is reduced and before the optimizer step: a worker
handed another batch is stopped before any update is made from it, naming the step, the workers and the first
input that differs. A step with no reduce-scatter (an evaluation, a no_sync() micro-batch) sends its fingerprint in
a small all-reduce of its own (`SLOT` numbers per worker, through the worker group's bounded collectives) when the
step function returns.

Why not an all-reduce of its own at every step: waited for at the start of `run` it cost 3.3% of a stage-3 MLP
step (a round trip before the step function); started there without waiting (Gloo's async_op) and waited for
before the first reduce-scatter, merely starting it took a median 3.4-3.9 ms of the training thread on the loaded
2-vCPU machine (Gloo's thread, woken in the middle of forward, competes for the same cores). Riding adds no
collective and no thread; it costs a copy of the first reduced unit's gradients (docs/sharded.md, measured).
TensorParallelStrategy has no such sum of its own on a `model` mesh: its fingerprint is sent alone, with `finish`.

    >>> agreement = StepAgreement(group, enabled=True)
    >>> batches = WorkerBatches(group, n, agreement.batch)   # notes each batch's fingerprint
    >>> agreement.start(step=1)                              # this step's fingerprint is due
    >>> comm.rider = agreement                               # rides the step's first reduce-scatter, compared there
    >>> agreement.finish()                                   # else sent alone; InputError naming who differs
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from stratagem.errors import InputError
from stratagem.strategies.worker_group.agreement import BatchAgreement

if TYPE_CHECKING:
    from stratagem.cluster.worker_group import WorkerGroup


def check_batches_flag(value: object) -> bool:
    """`check_batches=` as given, refused unless a bool."""
    if not isinstance(value, bool):
        raise InputError(f"check_batches must be True or False. Received: check_batches={value!r}. Pass a bool.")
    return value


class StepAgreement:
    """This worker's `BatchAgreement` and the comparison of every worker's fingerprint once per step.

    The fingerprint is sent with the check off too (the slot empty, nothing compared here): every worker makes the
    same collectives of the same sizes whatever each was given, so a worker whose check is off while others' is on
    is named by them, where a collective made by some workers only would be paired with another one (FSDP2's next
    all-gather) on the others."""

    def __init__(self, group: WorkerGroup, *, enabled: bool, strategy: str = "ShardedStrategy") -> None:
        self._group = group
        self.batch = BatchAgreement(rank=group.rank, task_names=group.task_names, enabled=enabled, strategy=strategy)
        self._due: tuple[int, bool] | None = None  # the step whose fingerprint is still to be sent, and its flag

    @property
    def enabled(self) -> bool:
        """Whether this worker compares the fingerprints (its `check_batches`)."""
        return self.batch.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self.batch.enabled = check_batches_flag(value)

    def start(self, step: int) -> None:
        """`step`'s fingerprint is due: it rides the step's first reduce-scatter, or `finish` sends it alone."""
        self._due = (step, self.batch.enabled)

    def ride(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """Every worker's slots, this worker's filled (exact in any floating-point dtype), for the reduce-scatter
        that asks: the first of the step; None for the others and outside a step."""
        if self._due is None:
            return None
        return self.batch.slots(self._due[0], dtype, device)

    def landed(self, summed: torch.Tensor) -> None:
        """Compares the summed slots with the chief's: raises `InputError` naming the step, the workers and the first
        input that differs, on every worker alike."""
        assert self._due is not None  # ride() was asked first
        (step, enabled), self._due = self._due, None
        values = summed.tolist()  # a host read: on the device path it waits for the sum (then check())
        self._group.cross_worker.check()
        if enabled:
            self.batch.check(values, step)

    def finish(self) -> None:
        """When the step function returns: a fingerprint that rode no reduce-scatter (a step without one on any
        worker, as every worker runs the same step) is summed alone, within the group's timeout, and compared."""
        if self._due is None:
            return
        step = self._due[0]
        slots = self.batch.slots(step, torch.float32, self._group.collective_device)
        self._group.cross_worker.all_reduce_([slots], what="batch agreement", step=step)
        self.landed(slots)

    def drop(self) -> None:
        """After the step function raised: the fingerprint is not sent (the job stops with that error)."""
        self._due = None
