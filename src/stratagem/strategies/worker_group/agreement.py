"""The workers of a synchronous job hold the same step and the same global batch, or the job stops.

Every worker computes its part of a step from the same global batch (each worker reads the same
loader, seeded alike). A worker handed another batch (a script that evaluates on the chief only
shifts the chief's random stream, and so its shuffle) would otherwise train on halves of two
different batches without a word. So each worker sends a small fingerprint of the step with the
gradient sum it makes anyway: `SLOT` numbers in a slot of its own (the other workers' slots are
zeros), after the gradients in the last all-reduce of the step. Summed, every worker holds every
worker's fingerprint and compares them with the chief's: all of them raise the same error at the
same step, naming the step, the workers and the first input that differs.

A fingerprint is bytes (each number 0-255, exact in every floating-point dtype, float16 and bfloat16
included, and a sum of one byte and zeros is exact): a flag, the training step, the global batch
size, how the batch was held (the global batch itself, or this worker's part cut at the index level,
whose sampler's indices are hashed instead, with, at the first batch of a pass and every
`data.probe.PROBE_EVERY` after it, the values of the global batch's first example, which every worker
reads for the check, since equal indices into data sets built differently are not the same batch; or
a part the worker read by itself, which has nothing to compare but the step), the number of inputs and a 24-bit hash of each of the first `MAX_INPUTS`. A
tensor's hash sums the raw bits of up to 64 values of each example in int64, then weights each example
by its position: exact integer arithmetic, so the same data gives the same hash whatever the number of
threads, and other examples or another order differ. (Examples that differ only in values between the
sampled ones are not told apart: the check is for batches drawn differently, at a fixed small cost.)

    >>> agreement = BatchAgreement(rank=0, task_names=["worker:0", "worker:1"])
    >>> agreement.note_global_batch((x, y), global_size=64)         # doctest: +SKIP
    >>> slots = agreement.slots(3, torch.float32)                   # summed with the gradients
    >>> agreement.check(summed_slots, step=3)                       # raises InputError naming who differs
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from stratagem.errors import InputError
from stratagem.values import flatten

MAX_INPUTS = 6
"""Inputs (tensors of the batch, in order) hashed one by one; the others are not compared."""
_HEAD = 1 + 4 + 3 + 1 + 1  # flag, step, global size, mode, number of inputs
SLOT = _HEAD + 3 * MAX_INPUTS
"""Numbers each worker sends per step."""

_NOTHING, _GLOBAL, _INDICES, _OWN = 0, 1, 2, 3
_MODES = {
    _NOTHING: "no batch given through the strategy",
    _GLOBAL: "the global batch",
    _INDICES: "its part of the global batch, cut at the index level",
    _OWN: "a part of its own (shard='off' or 'file', or a DistributedSampler)",
}
_DATA_SET_DIFFERS = "their data sets differ"
_ELEMENT_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


SAMPLES_PER_EXAMPLE = 64
"""Values of each example hashed (evenly strided through it): enough to tell other examples or another order,
at a cost that does not grow with the example's size."""


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """Per example (row along dimension 0): the int64 sum of the raw bits of at most `SAMPLES_PER_EXAMPLE`
    values, evenly strided. Exact integer arithmetic, so independent of the number of threads."""
    t = tensor.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    t = t.contiguous()
    if t.is_floating_point():
        t = t.view(_ELEMENT_INT[t.element_size()])
    rows = t.reshape(t.shape[0], -1) if t.dim() > 0 else t.reshape(1, 1)
    stride = max(1, -(-rows.shape[1] // SAMPLES_PER_EXAMPLE))
    return rows[:, ::stride].sum(1, dtype=torch.int64)  # each value widened as it is summed: no int64 copy


def _digest(tensor: torch.Tensor, weighted: int, plain: int) -> int:
    text = f"{tuple(tensor.shape)}|{tensor.dtype}|{weighted}|{plain}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=3).digest(), "little")


def tensor_digests(tensors: Sequence[torch.Tensor]) -> list[int]:
    """A 24-bit hash of each tensor's shape, dtype, values and their order along dimension 0 (see `_rows`): the
    per-example sums of the tensors with as many examples on one device go through one weighting and one read."""
    sums = [_rows(t) for t in tensors]
    out: dict[int, int] = {}
    groups: dict[tuple[int, torch.device], list[int]] = {}
    for i, per_row in enumerate(sums):
        groups.setdefault((per_row.numel(), per_row.device), []).append(i)
    for (n, device), members in groups.items():
        stacked = torch.stack([sums[i] for i in members])
        weights = torch.arange(1, n + 1, dtype=torch.int64, device=device)
        values = torch.cat([(stacked * weights).sum(1), stacked.sum(1)]).tolist()
        for k, i in enumerate(members):
            out[i] = _digest(tensors[i], values[k], values[len(members) + k])
    return [out[i] for i in range(len(tensors))]


def tensor_digest(tensor: torch.Tensor) -> int:
    """The 24-bit hash of one tensor (`tensor_digests`)."""
    return tensor_digests([tensor])[0]


def _bytes(value: int, count: int) -> list[int]:
    return [(value >> (8 * k)) & 0xFF for k in range(count)]


def _value(numbers: Sequence[float]) -> int:
    return sum(int(round(n)) << (8 * k) for k, n in enumerate(numbers))


class BatchAgreement:
    """This worker's fingerprint of the step, and the comparison of every worker's after the sum.

    `enabled=False` (the strategy's `check_batches=False`): the slot is sent empty and nothing is compared
    here; a worker that checks then names this one, since every worker must be built alike.
    `strategy`: the class named in the error's fix (where `check_batches=False` is passed).
    """

    def __init__(
        self,
        *,
        rank: int,
        task_names: Sequence[str],
        enabled: bool = True,
        strategy: str = "MultiWorkerMirroredStrategy",
    ) -> None:
        self.rank = rank
        self.strategy = strategy
        self.task_names = list(task_names)
        self.world_size = len(self.task_names)
        self.enabled = enabled
        self._noted: tuple[int, int, list[int], list[str]] = (_NOTHING, 0, [0], [])  # no tensors counted

    @property
    def size(self) -> int:
        """Numbers on the wire: one slot per worker."""
        return SLOT * self.world_size

    # ---- noting the batch ---------------------------------------------------------------------------
    def note_global_batch(self, batch: Any, global_size: int) -> None:
        """The step's global batch, as every worker holds it (before it is cut)."""
        if not self.enabled:
            return
        leaves = [(i, t) for i, t in enumerate(flatten(batch)) if isinstance(t, torch.Tensor)]
        digests = tensor_digests([t for _, t in leaves[:MAX_INPUTS]])
        described = [f"tensor {n} of the batch (shape {tuple(t.shape)}, {t.dtype})" for n, (_, t) in enumerate(leaves)]
        self._noted = (_GLOBAL, global_size, [len(leaves), *digests], described)

    def note_indices(self, digest: int | None, global_size: int, example: tuple[Any, int] | None = None) -> None:
        """This worker's part of a global batch cut at the index level: the digest of the global batch's indices,
        and `example`, (index, digest of its values) of the example every worker read for the check, or None."""
        if not self.enabled:
            return
        if digest is None:
            self._noted = (_OWN, global_size, [0], [])
            return
        described = [
            "the global batch's example indices (its sampler)",
            # Always noted, so that a batch without an example's digest (0) compares as one with it.
            "the global batch's first example"
            + ("" if example is None else f" (index {example[0]!r})")
            + ", which every worker reads for this check",
        ]
        self._noted = (_INDICES, global_size, [2, digest, 0 if example is None else example[1]], described)

    def note_own_part(self) -> None:
        """A part this worker read by itself: only the step can be compared."""
        if self.enabled:
            self._noted = (_OWN, 0, [0], [])

    # ---- the wire -----------------------------------------------------------------------------------
    def numbers(self, step: int) -> list[float]:
        """Every worker's slot, this worker's filled, the others zero: summed across workers, each slot holds
        its worker's fingerprint exactly."""
        out = [0.0] * self.size
        if self.enabled:
            mode, size, (count, *digests), _ = self._noted
            numbers = [1, *_bytes(step, 4), *_bytes(size, 3), mode, min(count, 255)]
            for digest in digests[:MAX_INPUTS]:
                numbers.extend(_bytes(digest, 3))
            start = self.rank * SLOT
            out[start : start + len(numbers)] = [float(n) for n in numbers]
        return out

    def slots(self, step: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """`numbers` as a tensor."""
        return torch.tensor(self.numbers(step), dtype=dtype, device=device)

    def check(self, summed: Sequence[float], step: int) -> None:
        """Raises `InputError` when a worker's fingerprint differs from the chief's (every worker raises the same)."""
        if not self.enabled:
            return
        slots = [list(summed[r * SLOT : (r + 1) * SLOT]) for r in range(self.world_size)]
        chief = slots[0]
        differing = [r for r in range(1, self.world_size) if slots[r] != chief]
        if not differing:
            return
        names = self.task_names
        first = differing[0]
        what = self._difference(chief, slots[first])
        workers = ", ".join(f"{names[r]} (rank {r})" for r in differing)
        if what.startswith(_DATA_SET_DIFFERS):
            fix = (
                "Training on it would silently train each worker on other data. Every worker must build the same "
                "data set: seed the random numbers that make it (torch.manual_seed before building it) and list "
                "its files in a fixed order (sorted)."
            )
        else:
            fix = (
                "Training on it would silently mix different batches. Every worker must be handed the same global "
                "batches in the same order: seed every worker's loader alike and draw the same random numbers on "
                "every worker (code that runs on the chief only, such as an evaluation with a shuffled loader, "
                "shifts its random stream)."
            )
        raise InputError(
            f"The workers disagree at step {step}: {workers} {'does' if len(differing) == 1 else 'do'} not hold what "
            f"the chief ({names[0]}, rank 0) holds; {what}. {fix} Pass check_batches=False to {self.strategy} (on "
            "every worker) to turn this check off."
        )

    def _difference(self, chief: list[float], theirs: list[float]) -> str:
        names = self.task_names
        if int(theirs[0]) == 0 or int(chief[0]) == 0:
            off = names[0] if int(chief[0]) == 0 else "that worker"
            return f"check_batches=False on {off} only. Received: the check on some workers and not on others"
        step_c, step_t = _value(chief[1:5]), _value(theirs[1:5])
        if step_c != step_t:
            return f"they are at different steps. Received: step {step_t} there, step {step_c} on the chief"
        mode_c, mode_t = int(chief[8]), int(theirs[8])
        if mode_c != mode_t:
            return f"the batches are held differently. Received: {_MODES[mode_t]} there, {_MODES[mode_c]} on the chief"
        size_c, size_t = _value(chief[5:8]), _value(theirs[5:8])
        if size_c != size_t:
            return f"the global batch sizes differ. Received: {size_t} examples there, {size_c} on the chief"
        count_c, count_t = int(chief[9]), int(theirs[9])
        if count_c != count_t:
            return f"the batches hold different numbers of tensors. Received: {count_t} there, {count_c} on the chief"
        described = self._noted[3]
        for n in range(min(count_c, MAX_INPUTS)):
            lo = _HEAD + 3 * n
            if chief[lo : lo + 3] != theirs[lo : lo + 3]:
                label = described[n] if n < len(described) else f"tensor {n} of the batch"
                if int(chief[9]) == 2 and n == 1 and int(chief[8]) == _INDICES:
                    return f"{_DATA_SET_DIFFERS}: {label}, has other values there. Received: a different hash of its values"
                return f"the first input that differs is {label}. Received: a different hash of its values there"
        return "their fingerprints differ. Received: different numbers in the fingerprint's tail"
