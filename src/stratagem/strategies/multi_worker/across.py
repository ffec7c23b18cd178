"""The sum across workers: MultiWorkerMirroredStrategy's part of its `ReplicaSet`.

Every worker holds the same replicas; once `distribute` has checked that the workers' models agree
and handed every worker the chief's values, the gradients of each backward pass are summed across
workers through `collective.cross_worker.CrossWorker` (Gloo, NCCL or one host's shared memory):

- one local replica: gradients are copied (and weighted) into buckets as backward produces them and
  each bucket's all-reduce starts at once, overlapping the rest of backward (`collective/buckets.py`);
  at the end of backward the buckets are waited for and handed out as the gradients;
- several local replicas: after the local combination, replica 0 sums every gradient across workers
  in one all-reduce (`collective/worker_sum.py`) while the other local replicas wait.

Declared loss weights (`sg.set_loss_weight`) travel with the gradients, so the total every worker
divides by is known without another round trip; so does each worker's fingerprint of the step and its
global batch (`agreement.BatchAgreement`), compared after the sum, so workers handed different batches
stop at once, and each worker's phase times of its last step (`stragglers.StragglerWatch`), so a worker
slower than its peers is named, with the phase it is slow in, while training continues. The part reports the cross-worker backend, the path
of the sums (shared memory or Gloo) and what the allocator does with freed host memory.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratagem import environ
from stratagem.cluster import allocator
from stratagem.cluster.worker_group import WorkerGroup
from stratagem.collective.buckets import GradientBuckets
from stratagem.collective.worker_sum import sum_gradients_across_workers
from stratagem.diagnose import PlacementDecision
from stratagem.errors import InputError
from stratagem.strategies.data_parallel import loss_weight
from stratagem.strategies.multi_worker.straggler_phases import ComputePhases
from stratagem.strategies.worker_group.agreement import BatchAgreement
from stratagem.strategies.worker_group.stragglers import StepTimes, Straggler, StragglerWatch

logger = logging.getLogger(__name__)


class AcrossWorkers:
    """Sums every backward pass's gradients across the workers of `group` (see the module docstring)."""

    def __init__(
        self,
        group: WorkerGroup,
        *,
        bucket_bytes: int,
        first_bucket_bytes: int,
        agreement: BatchAgreement,
        times: StepTimes,
        stragglers: StragglerWatch,
    ) -> None:
        self.group = group
        self.agreement = agreement
        self.times = times
        self.stragglers = stragglers
        self.phases = ComputePhases(world_size=group.world_size)  # a straggler's phase of compute, from a trace
        self.cw = group.cross_worker
        self.cw.start_pulse()  # fresh steps in stall warnings; a slow worker is told from a lost one
        self.world_size = group.world_size
        self.backend = group.backend
        self._devices = group.local_devices
        self._bucket_bytes = bucket_bytes
        self._first_bucket_bytes = first_bucket_bytes
        self._buckets: GradientBuckets | None = None
        self.sums_whole_backward = False
        self._step = 0
        self._bucket = 0  # the next bucket's index in this step, for the trace
        self._weights: tuple[float, int] = (0.0, 0)  # declared loss weights summed across workers, and how many
        self._recorded: list[PlacementDecision] = []

    # ---- set-up -------------------------------------------------------------------------------
    def connect_shared_memory(self, wanted: bool | None) -> None:
        """Sums of CPU tensors through one host's shared memory, where every worker runs on this host."""
        if self.backend == "nccl":
            if wanted:
                raise InputError(
                    "shared_memory=True sums CPU tensors, but this worker's replicas are on GPUs, which "
                    f"use NCCL. Received: devices {[str(d) for d in self._devices]}. Leave shared_memory "
                    "unset for GPUs."
                )
            return
        on_cpu = all(d.type == "cpu" for d in self._devices)
        why, fell_back = self.cw.connect_shared_memory(
            wanted=wanted is not False, why_not=None if on_cpu else "the replicas are on GPUs without NCCL"
        )
        if wanted and self.cw.shared is None:
            raise InputError(
                f"shared_memory=True, but the workers cannot sum through shared memory. Received: {why}. "
                "Leave shared_memory unset to use Gloo in that case."
            )
        if fell_back and self.group.is_chief:
            logger.warning(
                "Every worker runs on this host, but gradients cross workers through Gloo's loopback TCP, "
                "which is slower than shared memory: %s. Make room in /dev/shm (a container's "
                "--shm-size), or pass shared_memory=False to keep Gloo without this warning.",
                why,
            )
        choice = "shared memory" if self.cw.shared is not None else "gloo"
        self._recorded.append(PlacementDecision(subject="cross-worker sums", choice=choice, reason=why))

    def prepare(self, replicas: list[nn.Module], replica_params: list[list[nn.Parameter]]) -> None:
        """At `distribute`: the workers' models agree, every worker holds the chief's values, buckets exist."""
        self._check_same_model(replicas[0])
        self._broadcast_from_chief(replicas)
        if len(replicas) == 1:
            self._buckets = GradientBuckets(
                replica_params[0],
                bucket_bytes=self._bucket_bytes,
                first_bucket_bytes=self._first_bucket_bytes,
                count_users=True,
                after_host_read=self.cw.check,  # grad None where no worker used it, as on one device
                extra=self.agreement.size + self.stragglers.size + self.phases.size,
            )
            self.sums_whole_backward = True

    def _check_same_model(self, model: nn.Module) -> None:
        signature = [(name, tuple(t.shape), str(t.dtype)) for name, t in model.state_dict().items()]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, signature)
        chief = gathered[0]
        for rank, theirs in enumerate(gathered[1:], start=1):
            if theirs == chief:
                continue
            who = self.cw.task_names[rank]
            for (name_c, shape_c, dtype_c), (name_t, shape_t, dtype_t) in zip(chief, theirs):
                if (name_c, shape_c, dtype_c) != (name_t, shape_t, dtype_t):
                    raise InputError(
                        f"The workers' models differ: {who} has '{name_t}' of shape {shape_t} ({dtype_t}) where the "
                        f"chief ({self.cw.task_names[0]}) has '{name_c}' of shape {shape_c} ({dtype_c}). Every worker "
                        "must build the same model before strategy.distribute()."
                    )
            raise InputError(
                f"The workers' models differ: {who} has {len(theirs)} parameters and buffers, the chief has "
                f"{len(chief)}. Every worker must build the same model before strategy.distribute()."
            )

    def _broadcast_from_chief(self, replicas: list[nn.Module]) -> None:
        tensors = [t for t in replicas[0].state_dict(keep_vars=True).values()]
        with torch.no_grad():
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for t in tensors:
                by_dtype.setdefault(t.dtype, []).append(t)
            for group in by_dtype.values():
                flat = torch._utils._flatten_dense_tensors([t.detach() for t in group])
                work = dist.broadcast(flat, src=0, async_op=True)
                self.cw.wait([work], what="broadcast of the chief's parameters", step=0)
                for t, value in zip(group, torch._utils._unflatten_dense_tensors(flat, group)):
                    t.detach().copy_(value)
            for replica in replicas[1:]:
                replica.load_state_dict(replicas[0].state_dict())

    # ---- each step ----------------------------------------------------------------------------
    def begin_step(self, state: Any) -> None:
        self._step = state.step
        self._bucket = 0
        self.cw.heartbeat(state.step)
        if self._buckets is not None:
            self._buckets.start(state.weights[0])
            self._fill_tail(state.step)

    def _extra(self, step: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """What rides the gradient sum after the counts: the step's fingerprint, then the last step's phase times."""
        numbers = self.agreement.numbers(step) + self.stragglers.numbers(self.times)
        numbers += self.phases.numbers(self.group.rank, self.cw.trace.recorder)  # zeros while no trace records
        return torch.tensor(numbers, dtype=dtype, device=device)

    def _fill_tail(self, step: int) -> None:
        """This worker's slots after the counts (the sum overwrote the last ones)."""
        tail = self._buckets.extra_tail if self._buckets is not None else None
        if tail is not None:
            tail.copy_(self._extra(step, tail.dtype, tail.device))

    def _after_sum(self, summed: list[float], step: int) -> None:
        """Every worker's slots, summed: the fingerprints compared, the phase times judged."""
        size, end = self.agreement.size, self.agreement.size + self.stragglers.size
        self.agreement.check(summed[:size], step)
        self.phases.observe(summed[end:])
        found = self.stragglers.observe(summed[size:end], step, refine=self.phases.refine)
        if found is not None and self.group.is_chief:
            logger.warning("%s", found.describe())

    @property
    def straggler(self) -> Straggler | None:
        """The worker named slower than its peers at the last step, or None."""
        return self.stragglers.current

    def grad_ready(self, index: int, state: Any) -> None:
        if self._buckets is not None:
            self._buckets.mark_ready(index, self._launch)

    def _launch(self, flat: torch.Tensor) -> Any:
        start = time.perf_counter()  # through shared memory the sum is made here, waiting for the peers
        works = self.cw.all_reduce_async([flat], what="gradient all-reduce", step=self._step, bucket=self._bucket)
        self._bucket += 1
        self.times.communication_(time.perf_counter() - start)
        return works[0] if works else None

    def finish_backward(self, state: Any) -> None:
        """One local replica, at the end of backward: the last buckets go, every all-reduce is waited for
        (bounded; the error names the ranks missing) and each gradient becomes its view of its bucket."""
        assert self._buckets is not None  # sums_whole_backward: the buckets exist
        works = self._buckets.finish(self._launch)
        start = time.perf_counter()
        self.cw.wait(works, what="gradient all-reduce", step=state.step)
        self.times.communication_(time.perf_counter() - start)
        self.times.summed()
        self._buckets.hand_out()
        self._weights = self._buckets.declared_total()
        tail = self._buckets.extra_tail
        if tail is not None:
            summed = tail.tolist()  # after hand_out's host read of the counts: no further sync under NCCL
            self.cw.check()
            self._after_sum(summed, state.step)

    def after_backward(self, state: Any) -> None:
        """Ready for a second backward in the same step (after the gradients were divided, if they are)."""
        if self._buckets is not None:
            self._bucket = 0
            self._buckets.start(state.weights[0], declared=state.counts is not None)
            self._fill_tail(state.step)

    def sum_after_local_combine(self, replica: int, replica_params: list[list[nn.Parameter]], state: Any) -> None:
        """Several local replicas, after their combination: replica 0 sums across workers for all of them."""
        if replica == 0:
            declared = loss_weight.local_total(state.counts)
            start = time.perf_counter()
            reached = state.combined if state.combined is not None else range(len(replica_params[0]))
            total, count, summed, combined = sum_gradients_across_workers(
                self.cw,
                replica_params,
                reached,
                sum(state.weights),
                declared,
                state.step,
                extra=self._extra(state.step, torch.float64),
            )
            state.combined = combined  # read by every local replica after the meeting that follows
            self.times.communication_(time.perf_counter() - start)
            self.times.summed()
            self._weights = (total, count)
            if summed:
                self._after_sum(summed, state.step)

    def loss_weight_declared(self, count: float) -> None:
        if self._buckets is not None:
            self._buckets.declare_weight(count)

    def loss_weight_total(self, state: Any, num_replicas_in_sync: int) -> float | None:
        total, declared = self._weights  # summed along with the gradients
        return loss_weight.check_total(total, declared, num_replicas_in_sync, state.step)

    def batch_norm_sum(self, tensor: torch.Tensor, what: str, step: int) -> Any:
        return self.cw.all_reduce_([tensor], what=what, step=step)

    # ---- explain ------------------------------------------------------------------------------
    def decisions(self) -> list[PlacementDecision]:
        memory, why = allocator.describe(environ.current())  # read now: the allocator setting is the process's
        return [
            *self.group.decisions(),
            *self._recorded,
            PlacementDecision(subject="freed host memory", choice=memory, reason=why),
        ]

    def details(self) -> dict[str, str]:
        cluster = self.group.cluster
        details = {
            "cluster": f"{cluster.task_name}, rank {cluster.rank} of {cluster.world_size} (from {cluster.source})"
        }
        if self._buckets is not None:
            details["gradient buckets (MiB, in launch order)"] = self._buckets.describe()
        return details
