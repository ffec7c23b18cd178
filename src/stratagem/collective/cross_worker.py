"""Collectives across worker processes, every wait bounded, every failure naming who is missing.

Two paths, one set of promises. On the host path (Gloo, CPU tensors) `CrossWorker.wait` polls each
work handle's `is_completed()` against the deadline, then calls its `wait()`, which re-raises the
collective's error. On the device path (`device_collectives=True`: NCCL) the host does not wait:
each handle's `wait()` orders the current CUDA stream after the collective, and a watchdog thread
(`collective/watchdog.py`) polls the handles instead, so the CPU can queue the next step's work
while the GPU still communicates. Either way a stall warning is logged before the timeout with the
step each rank last reported, and when a collective fails or times out the surviving ranks hold a
roll call through the TCP store so the error names the task(s) that are gone, and tells a task that is
alive but behind (its pulse, a counter a thread of each worker advances in the store, still moves) from
one that is lost; on the device path
that error is raised by the next call here (or `check()`), and the process group is aborted so a
host blocked on the collective's result is released.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from stratagem.collective.flight import FlightRecord, process_group_backend
from stratagem.collective.roll_call import FLIGHT_NEWEST, compare_flights, publish_flight, roll_call
from stratagem.collective.store_calls import StoreCalls
from stratagem.collective.trace_hooks import CollectiveTrace
from stratagem.collective.watchdog import Watchdog
from stratagem.errors import CollectiveTimeoutError, ReplicaError

logger = logging.getLogger(__name__)

_STEP = "stratagem/step/{rank}"
_PULSE = "stratagem/pulse/{rank}"
PULSE_SECONDS = 0.5
"""How often each worker's pulse thread writes its step and a counter (less than the roll call's wait)."""
_POLL_FIRST_S = 50e-6
_POLL_MAX_S = 1e-3
ROLL_CALL_SECONDS = 2.0
"""How long, after a failure or timeout, the survivors wait for each other to sign in to the roll call."""


class CrossWorker:
    """This process's view of the collective world: rank, task names, timeouts, heartbeats.

    `device_collectives`: the collectives run on the GPU (NCCL), so `wait` hands the handles to a
    watchdog instead of blocking the host (see the module's docstring); `abort` is what the watchdog
    calls after a failure (default: abort the process group).

    Example:
        >>> cw = CrossWorker(store, rank=0, task_names=["worker:0", "worker:1"], timeout=60)
        >>> cw.all_reduce_([tensor], what="loss", step=3)
    """

    def __init__(
        self,
        store: Any,
        *,
        rank: int,
        task_names: Sequence[str],
        timeout: float,
        stall_warning_after: float | None = None,
        roll_call_seconds: float = ROLL_CALL_SECONDS,
        heartbeat_seconds: float = 1.0,
        device_collectives: bool = False,
        abort: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.task_names = list(task_names)
        self.world_size = len(self.task_names)
        self.timeout = float(timeout)
        self.stall_warning_after = stall_warning_after if stall_warning_after is not None else self.timeout / 4
        self.roll_call_seconds = roll_call_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self._last_step_reported = -1
        self._last_report_time = -float("inf")
        self._step = -1
        self._waiting = 0  # > 0 while the training thread waits in a collective here (host path)
        self._pulse: threading.Event | None = None
        self.shared: Any = None
        """The shared-memory group (`connect_shared_memory`), or None: every sum goes through the process group."""
        # Every call on the chief's store is bounded (torch's client can wait forever on a stopped chief).
        self._store_calls = StoreCalls(store, chief=self.task_names[0], caller=f"{self.task_name} (rank {rank})")
        self.watchdog: Watchdog | None = None
        """The device path's watchdog (None on the host path)."""
        self.trace = CollectiveTrace()
        """Where each collective and each wait is recorded while its recorder is on (`stratagem.trace`)."""
        self.flight = FlightRecord(self.task_name)
        """The last collectives, always kept: dumped and compared across workers when one fails (flight.py)."""
        self._in_flight: dict[int, int] = {}  # id of a process-group work handle -> its flight sequence number
        if device_collectives:
            self.watchdog = Watchdog(
                timeout=self.timeout,
                stall_warning_after=self.stall_warning_after,
                on_stall=self._warn_stall,
                on_failure=self._failure,
                abort=abort,
            )

    @property
    def task_name(self) -> str:
        return self.task_names[self.rank]

    def heartbeat(self, step: int) -> None:
        """Records the step this rank has reached (read back by stall warnings and failures).

        At most once per `heartbeat_seconds`: each report is a round trip to the chief's store,
        whose server thread competes for the same cores as the training, so the steps shown in
        errors are the last ones reported, at most that much behind.
        """
        self.check()
        self._step = step
        now = time.monotonic()
        if step != self._last_step_reported and now - self._last_report_time >= self.heartbeat_seconds:
            self._store_calls.run(
                f"the heartbeat of step {step}",
                self.store.set,
                _STEP.format(rank=self.rank),
                str(step),
                seconds=self.timeout,
            )
            self._last_step_reported = step
            self._last_report_time = now

    def start_pulse(self, seconds: float = PULSE_SECONDS) -> None:
        """Starts this worker's pulse: a daemon thread that writes, every `seconds`, the step this worker is at
        and a counter. It runs while the training thread is busy (a slow step, a long backward), so the others'
        stall warnings read a fresh step, and their roll call tells a slow worker (its counter moves) from a
        lost one."""
        if self._pulse is not None:
            return
        self._pulse = stop = threading.Event()
        key = _PULSE.format(rank=self.rank)

        newest_key = FLIGHT_NEWEST.format(rank=self.rank)

        def beat() -> None:
            count = 0
            reported = None
            while not stop.wait(seconds if count else 0.0):
                count += 1
                try:
                    self.store.set(key, f"{self._step} {count} {'waiting' if self._waiting else 'working'}")
                    newest = self.flight.newest()  # for the others' errors, should this worker stop answering
                    if newest is not None and newest != reported:
                        self.store.set(newest_key, json.dumps(newest))
                        reported = newest
                except Exception:  # noqa: BLE001 - the store is gone with the chief: the collectives report that
                    return

        threading.Thread(target=beat, daemon=True, name="stratagem-pulse").start()

    def pulses(self, seconds: float) -> dict[int, tuple[int, int, str]]:
        """Each rank's last pulse (step, counter, "waiting" in a collective or "working"), for the ranks that
        have one; within `seconds`."""
        return self._store_calls.run("a read of the pulses", self._read_pulses, seconds=seconds)

    def _read_pulses(self) -> dict[int, tuple[int, int, str]]:
        out: dict[int, tuple[int, int, str]] = {}
        for rank in range(self.world_size):
            key = _PULSE.format(rank=rank)
            try:
                if self.store.check([key]):
                    step, count, state = self.store.get(key).decode().split()
                    out[rank] = (int(step), int(count), state)
            except Exception:  # noqa: BLE001 - the store itself may be gone; that is reported elsewhere
                pass
        return out

    def steps_reached(self, seconds: float | None = None) -> dict[str, int | None]:
        """The last step each task reported, as far as the store knows.

        Waits for the store at most ``seconds`` (default: the timeout), then raises
        ``CollectiveTimeoutError`` naming the chief, which hosts the store.
        """
        return self._store_calls.run(
            "a read of the steps reached", self._read_steps, seconds=self.timeout if seconds is None else seconds
        )

    def _read_steps(self) -> dict[str, int | None]:
        """The step of each rank's pulse (fresh within `PULSE_SECONDS`), else of its last heartbeat."""
        pulses = self._read_pulses()
        out: dict[str, int | None] = {}
        for rank, name in enumerate(self.task_names):
            key = _STEP.format(rank=rank)
            try:
                step = int(self.store.get(key).decode()) if self.store.check([key]) else None
            except Exception:  # noqa: BLE001 - the store itself may be gone; that is reported elsewhere
                step = None
            if rank in pulses and (step is None or pulses[rank][0] > step):
                step = pulses[rank][0]
            out[name] = step
        return out

    # ---- collectives ------------------------------------------------------------------------
    def all_reduce_async(
        self, tensors: Sequence[torch.Tensor], *, what: str, step: int, bucket: int | None = None
    ) -> list[Any]:
        """Starts a SUM all-reduce of each tensor, in order; returns the work handles to `wait` for.

        A tensor the shared-memory group takes (`self.shared`: every worker on this host, a CPU tensor)
        is summed there and then, so it has no handle; the others start on the process group. `bucket`:
        the gradient bucket summed, for the trace.
        """
        self.check()
        works = []
        for tensor in tensors:
            if self.shared is not None and self.shared.supports(tensor):
                seq = self.trace.enter("all_reduce", what, step, tensor, shared=True, bucket=bucket)
                flown = self.flight.enter("all_reduce", what, step, tensor.nbytes, "shared memory")
                self._waiting += 1
                try:
                    self.shared.all_reduce_(tensor, what=what, step=step)
                finally:
                    self._waiting -= 1
                self.flight.done(flown)
                self.trace.summed_here(seq, what)
            else:
                seq = self.trace.enter("all_reduce", what, step, tensor, bucket=bucket)
                works.append(self._start_recorded("all_reduce", what, step, tensor, dist.all_reduce, tensor))
                self.trace.issued(seq, works[-1])
        return works

    def all_reduce_(self, tensors: Sequence[torch.Tensor], *, what: str, step: int) -> None:
        """SUM all-reduce in place, waiting at most `timeout`."""
        self.wait(self.all_reduce_async(tensors, what=what, step=step), what=what, step=step)

    def all_gather_bytes(
        self, payload: bytes, *, what: str, step: int, device: torch.device | None = None
    ) -> list[bytes]:
        """Every rank's `payload`, in rank order: the lengths are summed first (each rank fills its own slot),
        then the payloads, padded to the longest, travel in one all-gather; every wait is bounded by `wait`."""
        device = device or torch.device("cpu")
        lengths = torch.zeros(self.world_size, dtype=torch.int64, device=device)
        lengths[self.rank] = len(payload)
        # Through the process group, never the shared-memory sums: those are for floating-point gradients.
        seq = self.trace.enter("all_reduce", f"{what} (sizes)", step, lengths)
        work = self._start_recorded("all_reduce", f"{what} (sizes)", step, lengths, dist.all_reduce, lengths)
        self.trace.issued(seq, work)
        self.wait([work], what=f"{what} (sizes)", step=step)
        sizes = [int(n) for n in lengths.tolist()]  # a host read: on the device path it waits for the GPU
        self.check()  # the sizes came from a collective that did not fail
        longest = max(sizes)
        mine = torch.zeros(longest, dtype=torch.uint8, device=device)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        received = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(self.world_size)]
        seq = self.trace.enter("all_gather", what, step, mine)
        work = self._start_recorded("all_gather", what, step, mine, dist.all_gather, received, mine)
        self.trace.issued(seq, work)
        self.wait([work], what=what, step=step)
        payloads = [bytes(t[:n].cpu().numpy().tobytes()) for t, n in zip(received, sizes)]
        self.check()
        return payloads

    def _start_recorded(
        self, op: str, what: str, step: int, tensor: torch.Tensor, collective: Callable[..., Any], *args: Any
    ) -> Any:
        """`_start`s an asynchronous collective on the process group, kept in the flight record until `wait`
        sees it end (a SUM for an all-reduce)."""
        flown = self.flight.enter(op, what, step, tensor.nbytes, process_group_backend())
        kwargs: dict[str, Any] = {"op": dist.ReduceOp.SUM} if op == "all_reduce" else {}
        work = self._start(collective, *args, async_op=True, **kwargs)
        self._in_flight[id(work)] = flown
        return work

    def _start(self, collective: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Starts a collective; when that fails because the watchdog has just aborted the process group (from
        its thread), the watchdog's error, which names who is missing, is raised instead of torch's."""
        try:
            return collective(*args, **kwargs)
        except Exception:
            self.check()
            raise

    def connect_shared_memory(self, *, wanted: bool, why_not: str | None = None) -> tuple[str, bool]:
        """Every rank calls this once: sets `self.shared` when every worker runs on this host (and wants it).
        Returns the reason either way, in words, and whether the sums fell back to the process group although
        every worker runs on this host. `why_not`: this rank's own reason to stay on the process group."""
        from stratagem.shm import sums

        # The meeting's store calls end within the timeout, whatever the chief's store does.
        store = self._store_calls.bounded(self.timeout + self.roll_call_seconds, "the shared-memory meeting")
        self.shared, reason, fell_back = sums.connect(
            store,
            rank=self.rank,
            world_size=self.world_size,
            task_names=self.task_names,
            timeout=self.timeout,
            stall_warning_after=self.stall_warning_after,
            on_failure=self._failure,
            on_stall=self._warn_stall,
            why_not=why_not if wanted else sums.TURNED_OFF,
        )
        return reason, fell_back

    def check(self) -> None:
        """Raises the failure the watchdog recorded (device path): the CollectiveTimeoutError or ReplicaError
        naming who is missing. Call it after every host read of a device collective's result (`.tolist()`,
        `int()`): after a failure the process group is aborted and such a read returns whatever was there."""
        if self.watchdog is not None:
            self.watchdog.check()

    def close(self) -> None:
        if self._pulse is not None:
            self._pulse.set()
            self._pulse = None
        if self.watchdog is not None:
            self.watchdog.close()
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        self._store_calls.close()

    def wait(self, works: Sequence[Any], *, what: str, step: int) -> None:
        """Waits for work handles (None: a collective already done); raises an error naming the missing tasks
        on failure or timeout.

        Host path: poll each handle's `is_completed()` against the deadline, then call its `wait()`, which
        re-raises the collective's error. A future's `done()` cannot stand in for completion: for GPU work
        (NCCL) it turns true once the collective is queued. `wait(timeout)` is not used for the bound: for
        NCCL a timed-out wait may abort the communicator, which would turn a stall warning into a failure.

        Device path (`device_collectives`): each handle's `wait()` at once, which orders the current CUDA
        stream after the collective without blocking the host, then the watchdog polls `is_completed()`
        against the same deadline (`_hand_to_watchdog`). A read of the result on the host (`.tolist()`)
        then waits for the GPU, and must be followed by `check()`.
        """
        self.check()
        works = [w for w in works if w is not None]
        if not works:
            return
        if self.watchdog is not None:
            self._hand_to_watchdog(self.watchdog, works, what, step)
            return
        start = self.trace.wait_started()
        self._waiting += 1
        try:
            self._wait_host(works, what, step)
        finally:
            self._waiting -= 1
        for work in works:
            flown = self._in_flight.pop(id(work), None)
            if flown is not None:
                self.flight.done(flown)
        self.trace.waited(start, works, what)

    def _wait_host(self, works: Sequence[Any], what: str, step: int) -> None:
        start = time.monotonic()
        warn_at = start + min(self.stall_warning_after, self.timeout)
        deadline = start + self.timeout
        warned = False
        pause = _POLL_FIRST_S
        for work in works:
            while not self._completed(work, what, step):
                now = time.monotonic()
                if now >= deadline:
                    raise self._failure(what, step, None)
                if not warned and now >= warn_at:
                    self._warn_stall(what, step, start)
                    warned = True
                # A short, growing pause (the GIL released): a collective that ends within microseconds costs
                # little latency, one that runs for seconds at most _POLL_MAX_S of wake-ups.
                time.sleep(min(pause, max(0.0, deadline - now)))
                pause = min(2 * pause, _POLL_MAX_S)
            try:
                work.wait()
            except Exception as error:  # noqa: BLE001 - translated into an error that names the missing task
                raise self._failure(what, step, error) from error

    def _hand_to_watchdog(self, watchdog: Watchdog, works: Sequence[Any], what: str, step: int) -> None:
        """The device path: each handle's `wait()` at once, then the watchdog polls it.

        ProcessGroupNCCL's `WorkNCCL::wait` (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp) calls
        `synchronize()`, which blocks the current CUDA stream on the collective's end event
        (`ncclEndEvent_->block(currentStream)`), and blocks the CPU thread only "in case of blockingWait or a
        timeout value is specified by the user": so without TORCH_NCCL_BLOCKING_WAIT=1, and with no timeout
        given here, it returns at once and later work on this stream runs after the sum has landed
        (torch.distributed's docs: the output can then be used on that stream without further sync). With
        TORCH_NCCL_BLOCKING_WAIT=1 it blocks up to the process group's timeout, which is longer than ours
        (cluster/worker_group.py): the watchdog still fires first, and its abort ends that wait.
        """
        for work in works:
            try:
                work.wait()
            except Exception as error:  # noqa: BLE001 - translated into an error that names the missing task
                self.check()  # the watchdog's abort ended this wait: its error is the one to raise
                raise self._failure(what, step, error) from error
        watchdog.watch(works, what=what, step=step)

    def _completed(self, work: Any, what: str, step: int) -> bool:
        try:
            return bool(work.is_completed())
        except Exception as error:  # noqa: BLE001 - a handle that cannot even say so has failed
            raise self._failure(what, step, error) from error

    def _warn_stall(self, what: str, step: int, start: float) -> None:
        # The steps are read within what is left of the timeout, and no longer than the warning's own delay.
        left = self.timeout - (time.monotonic() - start)
        steps = self._format_steps(max(0.01, min(left, self.stall_warning_after)))
        logger.warning(
            "%s has waited %.0f s for the %s of step %d; steps reached: %s",
            self.task_name,
            time.monotonic() - start,
            what,
            step,
            steps,
        )

    # ---- failure reports ----------------------------------------------------------------------
    def _format_steps(self, seconds: float) -> str:
        try:
            steps = self.steps_reached(seconds)
            pulses = self._pulses_quietly(seconds)
        except CollectiveTimeoutError:
            return f"unknown (the chief's store, {self.task_names[0]}, did not answer within {seconds:g} s)"
        states = {self.task_names[r]: p[2] for r, p in pulses.items()}
        text = ", ".join(
            f"{name}: {'-' if s is None else s}{f' ({states[name]})' if name in states else ''}"
            for name, s in steps.items()
        )
        known = [s for s in steps.values() if s is not None]
        # Behind: at an earlier step than the furthest, or at the same step but still working while others wait.
        behind = [
            name
            for name, s in steps.items()
            if s is not None and (s < max(known) or (states.get(name) == "working" and "waiting" in states.values()))
        ]
        return text + (f"; behind: {', '.join(behind)}" if behind else "")

    def _failure(self, what: str, step: int, error: Exception | None) -> Exception:
        before = self._pulses_quietly()
        calls, seconds = self._store_calls, self.roll_call_seconds  # flight record first: the others read it after
        dumped = publish_flight(self.flight, calls, self.store, step, self.rank, seconds)  # their roll calls
        missing, store_ok = roll_call(calls, self.store, step, self.rank, self.world_size, seconds)
        after = self._pulses_quietly() if missing and store_ok else {}
        if missing and store_ok and any(r in before for r in missing) and not _moved(before, after, missing):
            # The roll call ended early (or the pulses were read too close together): wait one pulse more.
            time.sleep(PULSE_SECONDS * 1.5)
            after = self._pulses_quietly()
        alive = [r for r in missing if _moved(before, after, [r])]
        lost = [r for r in missing if r not in alive]
        cause = "timed out" if error is None else f"failed ({_first_line(error)})"
        if not store_ok:
            who = f"the chief ({self.task_names[0]}), which hosts the rendezvous store, is unreachable"
        elif missing:
            parts = []
            if alive:
                parts.append(
                    "alive but behind (slow, not gone: its pulse still moves): "
                    + ", ".join(
                        f"{self.task_names[r]} (rank {r}) at step {after[r][0]}, "
                        + ("waiting in another collective" if after[r][2] == "waiting" else "still working")
                        for r in alive
                    )
                )
            if lost:
                parts.append("lost: " + ", ".join(f"{self.task_names[r]} (rank {r})" for r in lost))
            who = "; ".join(parts)
        else:
            who = "every task answered the roll call, so one is stuck rather than gone"
        message = (
            f"{self.task_name} (rank {self.rank}): the {what} of step {step} {cause} after waiting for the other "
            f"workers; {who}. Steps last reported: {self._format_steps(self.roll_call_seconds) if store_ok else 'unknown'}. "
            f"Collectives: {compare_flights(calls, self.store, step, self.task_names, missing, seconds) if store_ok else 'unknown'}"
            f"{f' (this worker kept its last {len(self.flight.entries())} in {dumped})' if dumped else ''}. Restart the job "
            "(stratagem launch --max-restarts restarts the group) and resume from the last checkpoint."
        )
        if error is None:
            return CollectiveTimeoutError(message)
        return ReplicaError(message)

    def _pulses_quietly(self, seconds: float | None = None) -> dict[int, tuple[int, int, str]]:
        try:
            return self.pulses(self.roll_call_seconds if seconds is None else seconds)
        except CollectiveTimeoutError:
            return {}


def _moved(before: dict[int, tuple[int, int, str]], after: dict[int, tuple[int, int, str]], ranks: list[int]) -> bool:
    """Whether every rank of `ranks` wrote a newer pulse between the two reads."""
    return all(r in before and r in after and after[r][1] > before[r][1] for r in ranks)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__
