"""Sums across worker processes of one machine through shared memory instead of Gloo's loopback TCP.

When every worker of a job runs on the same host (a local cluster under ``stratagem launch``, or
several CPU workers on one node), their tensors need not cross a socket. Each process maps one
file in ``/dev/shm`` (gone from the directory once every rank has mapped it, see ``files``); to
sum a tensor, every rank copies it into its own slot of the file, then sums one slice of all the
slots while the others sum theirs, then copies the whole sum back. Gloo on loopback moves the
same bytes through the kernel and wakes two of its threads per message on each side: on a 2-core
machine a 0.23 MiB all-reduce took 0.77 ms (median, 4.3 ms at the 90th percentile) and a 6.1 MiB
one 7.4 ms.

The file::

    header (64 bytes: magic, a nonce every rank checks, the world size and slot size)
    one 64-byte line per rank: two counters, "arrived" and "summed" (a line each, so ranks never
        write to the same cache line)
    world_size slots of ``capacity`` bytes (rank r writes only slot r)
    one result area of ``capacity`` bytes

Collective number ``s`` (every rank makes the same collectives in the same order, as with any
process group), for each chunk of at most ``capacity`` bytes:

1. copy the chunk into my slot, then ``arrived[me] = s``;
2. wait until ``arrived[q] >= s`` for every rank q;
3. ``result[my slice] = slot[0][slice] + slot[1][slice] + ...``, always in rank order, so every
   rank ends with the same bits whichever rank summed which slice;
4. ``summed[me] = s``; wait until ``summed[q] >= s`` for every q;
5. copy ``result`` back into the chunk.

ShardedStrategy's all-gather (``all_gather_into_``) and reduce-scatter (``reduce_scatter_``) take
the same steps and counters: the all-gather copies every slot out at step 3 and has no result;
the reduce-scatter's chunk holds the same stretch of each rank's block, and at step 3 each rank
sums its own block's stretch from every slot, in rank order, straight into its output.

Why no rank overwrites what another still reads: a rank writes its slot for collective ``s + 1``
only after step 4 of ``s``, when every rank has finished reading the slots (step 3). A rank writes
the result of ``s + 1`` only after every rank arrived at ``s + 1``, that is after each finished
step 5 of ``s``, the last read of the result of ``s``.

Counters are 8-byte aligned stores published after the data, read before it (``counters``: x86-64's
store order makes that enough; other architectures use Gloo, see ``eligible``). A waiting rank
spins for a few microseconds, then sleeps on a futex of the counter it waits for; the rank that
moves a counter wakes its sleepers. ``STRATAGEM_SHARED_MEMORY=0`` keeps every rank on Gloo
(``eligibility``). Every wait is bounded: it checks twenty times a second whether the ranks it
waits for are still running (their pid and start time, exchanged when the group is made; a peer
whose process this one cannot see, in another pid namespace, is left to the timeout) and gives up
after the timeout, naming them.
"""

from __future__ import annotations

import itertools
import json
import logging
import mmap
import os
import secrets
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, cast

import torch

from stratagem.errors import CollectiveTimeoutError, ReplicaError
from stratagem.shm import eligibility, files
from stratagem.shm.counters import Counters
from stratagem.shm.eligibility import TURNED_OFF
from stratagem.shm.files import host_identity, process_start

logger = logging.getLogger(__name__)

MAGIC = b"SGSHM001"
_HEADER = 64
_LINE = 64  # bytes per rank's counters
_ARRIVED, _SUMMED = 0, 1
DEFAULT_CAPACITY = 4 << 20
"""Bytes of one slot: larger tensors go through in chunks of this size (a 2-worker job maps 12 MiB)."""
SPIN_SECONDS = 50e-6
"""How long a waiting rank polls before it sleeps: long enough to catch a peer that is microseconds
behind, short enough not to take a core from a peer still computing."""
CHECK_SECONDS = 0.05
"""How often a sleeping rank wakes to check that the ranks it waits for are alive, and the clock."""
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64)

_connections = itertools.count()  # store keys of the n-th group made in this process (every rank makes the same ones)


def eligible(directory: str = files.DIRECTORY) -> str | None:
    """None when this process can sum through shared memory in ``directory``, else why not."""
    return eligibility.why_not("shared-memory sums", directory, ordered=True)


class SharedMemoryGroup:
    """One rank's side of the shared file (see the module's docstring). Use ``connect`` to make one.

    ``all_reduce_`` sums a contiguous CPU tensor in place across the ranks; on a wait that runs out,
    or a rank that exited, it raises the error ``on_failure(what, step, error)`` makes (None for a
    timeout), and the group is then unusable, as a process group is after a failed collective.
    """

    def __init__(
        self,
        mapping: mmap.mmap,
        *,
        rank: int,
        world_size: int,
        capacity: int,
        processes: Sequence[tuple[int, str | None]],
        task_names: Sequence[str],
        timeout: float,
        stall_warning_after: float,
        on_failure: Callable[[str, int, Exception | None], Exception],
        on_stall: Callable[[str, int, float], None],
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.capacity = capacity
        self.processes = [cast("tuple[int, str | None]", tuple(p)) for p in processes]  # pairs, as annotated
        # A peer in another pid namespace is not visible here (or another process has its number): its death is
        # then found by the timeout only.
        self._watched = [start is not None and process_start(pid) == start for pid, start in self.processes]
        self.task_names = list(task_names)
        self.timeout = timeout
        self.stall_warning_after = stall_warning_after
        self._on_failure = on_failure
        self._on_stall = on_stall
        self._mapping = mapping
        self._bytes = files.as_tensor(mapping)
        self._counters = Counters(mapping, count=world_size * _LINE // 8, offset=_HEADER)
        self._slots = _HEADER + world_size * _LINE
        self._results = self._slots + world_size * capacity
        self._typed: dict[torch.dtype, tuple[list[torch.Tensor], torch.Tensor]] = {}
        self._seq = 0
        self._broken: str | None = None

    # ---- the collective -----------------------------------------------------------------------
    def supports(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.dtype in DTYPES and tensor.is_contiguous()

    def all_reduce_(self, tensor: torch.Tensor, *, what: str, step: int) -> None:
        """Sums ``tensor`` (contiguous, on the CPU, of a dtype in ``DTYPES``) across the ranks, in place."""
        self._check_usable()
        flat = tensor.detach().view(-1)
        per_chunk = self.capacity // flat.element_size()
        for start in range(0, max(flat.numel(), 1), per_chunk):
            self._reduce_chunk(flat[start : start + per_chunk], what, step)

    def _reduce_chunk(self, chunk: torch.Tensor, what: str, step: int) -> None:
        n = chunk.numel()
        self._seq += 1
        seq = self._seq
        slots, result_area = self._areas(chunk.dtype)
        slots[self.rank][:n].copy_(chunk)
        self._publish(_ARRIVED, seq)
        self._wait_all(_ARRIVED, seq, what, step)
        result = result_area[:n]
        lo, hi = n * self.rank // self.world_size, n * (self.rank + 1) // self.world_size
        if hi > lo:
            out = result[lo:hi]
            torch.add(slots[0][lo:hi], slots[1][lo:hi], out=out)
            for slot in slots[2:]:
                out.add_(slot[lo:hi])
        self._publish(_SUMMED, seq)
        self._wait_all(_SUMMED, seq, what, step)
        chunk.copy_(result)

    def all_gather_into_(self, output: torch.Tensor, tensor: torch.Tensor, *, what: str, step: int) -> None:
        """Fills ``output`` (``world_size * tensor.numel()`` elements) with every rank's ``tensor``, in rank order.

        FSDP2's all-gather of a unit's shards (``strategies/sharded/transport.py``): each chunk is copied into
        this rank's slot and, once every rank arrived, all the slots into ``output``; moved as bytes, any dtype.
        """
        self._check_usable()
        source = tensor.detach().reshape(-1).view(torch.uint8)
        out = output.detach().view(-1).view(torch.uint8).view(self.world_size, source.numel())
        slots = self._bytes[self._slots : self._results].view(self.world_size, self.capacity)
        # FSDP2 copies a rank's shards into its own block of the output first (`all_gather_copy_in`): then that
        # block is already in place, and only the other ranks' blocks are copied out.
        others = [q for q in range(self.world_size) if q != self.rank or out[q].data_ptr() != source.data_ptr()]
        for start in range(0, max(source.numel(), 1), self.capacity):
            n = min(self.capacity, source.numel() - start)
            self._seq += 1
            slots[self.rank, :n].copy_(source[start : start + n])
            self._publish(_ARRIVED, self._seq)
            self._wait_all(_ARRIVED, self._seq, what, step)
            for q in others:
                out[q, start : start + n].copy_(slots[q, :n])
            self._publish(_SUMMED, self._seq)  # read: the slots may be written again
            self._wait_all(_SUMMED, self._seq, what, step)

    def reduce_scatter_(
        self, output: torch.Tensor, tensor: torch.Tensor, *, what: str, step: int, scale: float = 1.0
    ) -> None:
        """Sets ``output`` to this rank's block of the sum of every rank's ``tensor`` (``world_size`` blocks of
        ``output.numel()`` elements), summed in rank order as ``all_reduce_`` sums, with the same dtypes; with
        ``scale``, of every rank's ``tensor * scale`` (multiplied on the way into the slot: one pass, the same bits
        as ``tensor.mul_(scale)`` first).

        FSDP2's reduce-scatter of a unit's gradients: each chunk holds the same stretch of every block, so a rank
        sums only its own block's stretch, straight from the slots into ``output``; no result area, no copy back.
        """
        self._check_usable()
        size = output.numel()
        blocks = tensor.detach().view(self.world_size, size)
        out = output.detach().view(-1)
        per_chunk = max(self.capacity // (self.world_size * tensor.element_size()), 1)
        slots, _ = self._areas(tensor.dtype)
        for start in range(0, max(size, 1), per_chunk):
            n = min(per_chunk, size - start)
            self._seq += 1
            mine_in = slots[self.rank][: self.world_size * n].view(self.world_size, n)
            if scale == 1.0:
                mine_in.copy_(blocks[:, start : start + n])
            else:
                torch.mul(blocks[:, start : start + n], scale, out=mine_in)
            self._publish(_ARRIVED, self._seq)
            self._wait_all(_ARRIVED, self._seq, what, step)
            mine = [slot[self.rank * n : (self.rank + 1) * n] for slot in slots]
            target = out[start : start + n]
            torch.add(mine[0], mine[1], out=target)
            for piece in mine[2:]:
                target.add_(piece)
            self._publish(_SUMMED, self._seq)
            self._wait_all(_SUMMED, self._seq, what, step)

    def _check_usable(self) -> None:
        if self._bytes is None:  # close() ran: a sharded model used after its strategy was closed reaches here
            raise ReplicaError(
                "The shared-memory group of this strategy was closed (strategy.close()). Received: another "
                "collective (a sharded model's forward or backward after close). Train and evaluate the model "
                "before close(), or make a new strategy and distribute the model again."
            )
        if self._broken is not None:
            raise ReplicaError(
                f"The shared-memory group is unusable after an earlier failure ({self._broken}). "
                "Received: another collective. Restart the job."
            )

    def _areas(self, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Every slot and the result area as 1-D tensors of ``dtype`` (made once per dtype)."""
        areas = self._typed.get(dtype)
        if areas is None:

            def area(offset: int) -> torch.Tensor:
                return self._bytes[offset : offset + self.capacity].view(dtype)

            areas = self._typed[dtype] = (
                [area(self._slots + q * self.capacity) for q in range(self.world_size)],
                area(self._results),
            )
        return areas

    # ---- counters -----------------------------------------------------------------------------
    def _index(self, rank: int, kind: int) -> int:
        return rank * (_LINE // 8) + kind

    def _publish(self, kind: int, seq: int) -> None:
        self._counters.publish(self._index(self.rank, kind), seq)

    def _wait_all(self, kind: int, seq: int, what: str, step: int) -> None:
        start = None
        words = self._counters.words
        for q in range(self.world_size):
            index = self._index(q, kind)
            if words[index] >= seq:
                continue
            if start is None:
                start = time.monotonic()
            self._wait_one(q, index, seq, what, step, start)

    def _wait_one(self, q: int, index: int, seq: int, what: str, step: int, start: float) -> None:
        warned = False

        def check() -> None:  # after each sleep that did not see rank q arrive
            nonlocal warned
            waited = time.monotonic() - start
            pid, started = self.processes[q]
            if self._watched[q] and process_start(pid) != started:
                self._broken = f"{self.task_names[q]} exited"
                # The cause of on_failure's error, which says what to do: a fragment of its message.
                raise self._on_failure(
                    what, step, ReplicaError(f"{self.task_names[q]} (pid {pid}) exited during the shared-memory {what}")
                )
            if waited >= self.timeout:
                self._broken = f"timed out waiting for {self.task_names[q]}"
                raise self._on_failure(what, step, None)
            if not warned and waited >= self.stall_warning_after:
                self._on_stall(what, step, start)
                warned = True

        self._counters.wait(index, seq, spin=SPIN_SECONDS, check_every=CHECK_SECONDS, check=check)

    def close(self) -> None:
        """Unmaps the file (already unlinked: nothing is left in /dev/shm)."""
        if self._mapping.closed:
            return
        self._counters.close()
        self._bytes = None  # type: ignore[assignment]
        self._typed.clear()
        try:
            self._mapping.close()
        except BufferError:  # a view of it is still referenced somewhere: the mapping goes when that view does
            logger.debug("the shared-memory mapping is still viewed; it is unmapped when the last view is freed")


def connect(
    store: Any,
    *,
    rank: int,
    world_size: int,
    task_names: Sequence[str],
    timeout: float,
    stall_warning_after: float,
    on_failure: Callable[[str, int, Exception | None], Exception],
    on_stall: Callable[[str, int, float], None],
    capacity: int = DEFAULT_CAPACITY,
    directory: str = "/dev/shm",
    host: str | None = None,
    why_not: str | None = None,
    namespace: str | None = None,
    process: tuple[int, str | None] | None = None,
) -> tuple[SharedMemoryGroup | None, str, bool]:
    """Meets the other ranks through ``store`` and maps one shared file if every rank can; returns the group
    (or None), the reason in words (for ``explain()``), and whether the sums fall back to the process group
    although every worker runs on this host and none turned this off (a slower job the user should hear of).

    ``why_not``: this rank's own reason to stay out (which keeps every rank out). ``namespace``: the store
    keys of this meeting (default: one per call in this process, the same on every rank as long as every
    rank makes the same groups in the same order, as it makes its process groups). ``process``: the pid and
    start time others watch for this rank (default: this process). Every rank takes part,
    and every rank gets the same answer: rank 0 decides from what each rank
    published (its host, its pid, whether it can take part), creates the file, and unlinks it once
    every rank has mapped it and checked its nonce (so the file is gone even if the job is killed).
    """
    prefix = f"stratagem/shm/{next(_connections) if namespace is None else namespace}/"
    wait = timedelta(seconds=timeout)

    def wait_for(keys: list[str], what: str) -> None:
        try:
            store.wait(keys, wait)
        except Exception as exc:  # noqa: BLE001 - a store wait that runs out: name who did not publish
            missing = (
                [task_names[r] for r, key in enumerate(keys) if not store.check([key])]
                if len(keys) > 1
                else [task_names[0]]
            )
            raise CollectiveTimeoutError(
                f"{task_names[rank]} (rank {rank}) waited {timeout:g} s for {what} from {', '.join(missing)}. "
                f"Received: {type(exc).__name__}. Check that every worker is running, or raise the timeout."
            ) from None

    pid, started = process or (os.getpid(), process_start(os.getpid()))
    # "off": this rank's user (shared_memory=False) or its switch turned the sums off, so nobody is told they are
    # slower than they could be.
    off = why_not == TURNED_OFF or eligibility.turned_off() is not None
    me = {
        "host": host or host_identity(),
        "pid": pid,
        "start": started,
        "why_not": why_not or eligible(directory),
        "off": off,
    }
    store.set(f"{prefix}rank/{rank}", json.dumps(me))
    ranks = [f"{prefix}rank/{r}" for r in range(world_size)]
    wait_for(ranks, "the shared-memory check-in")
    infos = [json.loads(value) for value in store.multi_get(ranks)]
    size = _HEADER + world_size * _LINE + (world_size + 1) * capacity
    # The file's path once this rank knows it. Whichever way this rank leaves the meeting, it removes the name:
    # normally every rank has mapped the file by then (or never will), and if the meeting fails (the chief's
    # store gone with the chief, say) nobody will map it, so nothing is left in /dev/shm.
    path = None
    mapping: mmap.mmap | None = None
    try:
        if rank == 0:
            offer: dict[str, Any] = {
                "path": None,
                "nonce": secrets.token_hex(16),
                "why_not": _decide(infos, task_names, world_size),
            }
            if offer["why_not"] is None:
                path, offer["why_not"] = files.create(directory, size, _head(offer["nonce"], world_size, capacity))
                offer["path"] = path
            store.set(f"{prefix}file", json.dumps(offer))
        wait_for([f"{prefix}file"], "the shared file's name")
        offer = json.loads(store.get(f"{prefix}file"))
        path = offer["path"]
        mapping, problem = None, offer["why_not"]
        if problem is None:
            mapping, problem = files.open_mapped(
                offer["path"], size, _head(offer["nonce"], world_size, capacity), maker="rank 0"
            )
            problem = None if problem is None else f"{task_names[rank]}: {problem}"
        store.set(f"{prefix}mapped/{rank}", json.dumps(problem))
        mapped = [f"{prefix}mapped/{r}" for r in range(world_size)]
        wait_for(mapped, "the shared-memory mapping")
        problems = [json.loads(value) for value in store.multi_get(mapped)]
    except BaseException:
        if mapping is not None:
            mapping.close()
        raise
    finally:
        if path is not None:
            files.unlink(path)
    refused = [p for p in problems if p is not None]
    if refused:
        if mapping is not None:
            mapping.close()
        one_host = world_size > 1 and len({info["host"] for info in infos}) == 1
        return None, refused[0], one_host and not any(info["off"] for info in infos)
    assert mapping is not None  # no rank refused, this one included: it mapped the file
    group = SharedMemoryGroup(
        mapping,
        rank=rank,
        world_size=world_size,
        capacity=capacity,
        processes=[(info["pid"], info["start"]) for info in infos],
        task_names=task_names,
        timeout=timeout,
        stall_warning_after=stall_warning_after,
        on_failure=on_failure,
        on_stall=on_stall,
    )
    return (
        group,
        (
            f"all {world_size} workers run on this host, so gradients are summed through shared memory "
            f"({size / 2**20:.1f} MiB in {directory}) instead of Gloo's loopback TCP"
        ),
        False,
    )


def _decide(infos: list[dict[str, Any]], task_names: Sequence[str], world_size: int) -> str | None:
    """Rank 0's decision from every rank's check-in: None (go ahead) or why not."""
    if world_size < 2:
        return "one worker: nothing to sum across processes"
    reasons = [info["why_not"] for info in infos]
    if reasons[0] is not None and len(set(reasons)) == 1:
        return reasons[0]  # the same on every worker
    for r, why in enumerate(reasons):
        if why is not None:
            return f"{task_names[r]}: {why}"
    hosts = {info["host"] for info in infos}
    if len(hosts) > 1:
        return f"the workers run on {len(hosts)} hosts"
    return None


def _head(nonce: str, world_size: int, capacity: int) -> bytes:
    """The first bytes of the file: magic, rank 0's nonce, the world size and the slot size."""
    return MAGIC + bytes.fromhex(nonce) + world_size.to_bytes(8, "little") + capacity.to_bytes(8, "little")
