"""Collectives across worker processes, every wait bounded, every failure naming who is missing.

Waits go through futures with a done-callback and an Event (no polling), or, for Gloo, through
each work handle's own bounded wait, which blocks in C++ without the GIL. Before the timeout
runs out a stall warning is logged with the step each rank last reported; when a collective
fails or times out, the surviving ranks hold a roll call through the TCP store so the error
names the task(s) that are gone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from stratagem.collective.store_calls import StoreCalls
from stratagem.errors import CollectiveTimeoutError, ReplicaError

logger = logging.getLogger(__name__)

_STEP = "stratagem/step/{rank}"
_ROLL_CALL = "stratagem/rollcall/{step}/{rank}"


class CrossWorker:
    """This process's view of the collective world: rank, task names, timeouts, heartbeats.

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
        roll_call_seconds: float = 2.0,
        heartbeat_seconds: float = 1.0,
        blocking_waits: bool = False,
    ) -> None:
        self.store = store
        self.rank = rank
        self.task_names = list(task_names)
        self.world_size = len(self.task_names)
        self.timeout = float(timeout)
        self.stall_warning_after = stall_warning_after if stall_warning_after is not None else self.timeout / 4
        self.roll_call_seconds = roll_call_seconds
        self.heartbeat_seconds = heartbeat_seconds
        # Gloo's work handles wait in C++ with a timeout and the GIL released. The futures path instead
        # needs a callback on Gloo's thread (which must take the GIL) to wake this one through an Event:
        # 0.4-1 ms of a 90-105 ms CNN step on 2 cores in in-process A/B runs, close to their noise.
        self.blocking_waits = blocking_waits
        self._last_step_reported = -1
        self._last_report_time = -float("inf")
        self.shared: Any = None
        """The shared-memory group (`connect_shared_memory`), or None: every sum goes through the process group."""
        # Every call on the chief's store is bounded (torch's client can wait forever on a stopped chief).
        self._store_calls = StoreCalls(store, chief=self.task_names[0], caller=f"{self.task_name} (rank {rank})")

    @property
    def task_name(self) -> str:
        return self.task_names[self.rank]

    def heartbeat(self, step: int) -> None:
        """Records the step this rank has reached (read back by stall warnings and failures).

        At most once per `heartbeat_seconds`: each report is a round trip to the chief's store,
        whose server thread competes for the same cores as the training, so the steps shown in
        errors are the last ones reported, at most that much behind.
        """
        now = time.monotonic()
        if step != self._last_step_reported and now - self._last_report_time >= self.heartbeat_seconds:
            self._store_calls.run(f"the heartbeat of step {step}", self.store.set, _STEP.format(rank=self.rank),
                                  str(step), seconds=self.timeout)
            self._last_step_reported = step
            self._last_report_time = now

    def steps_reached(self, seconds: float | None = None) -> dict[str, int | None]:
        """The last step each task reported, as far as the store knows.

        Waits for the store at most ``seconds`` (default: the timeout), then raises
        ``CollectiveTimeoutError`` naming the chief, which hosts the store.
        """
        return self._store_calls.run("a read of the steps reached", self._read_steps,
                                     seconds=self.timeout if seconds is None else seconds)

    def _read_steps(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for rank, name in enumerate(self.task_names):
            key = _STEP.format(rank=rank)
            try:
                out[name] = int(self.store.get(key).decode()) if self.store.check([key]) else None
            except Exception:  # noqa: BLE001 - the store itself may be gone; that is reported elsewhere
                out[name] = None
        return out

    # ---- collectives ------------------------------------------------------------------------
    def all_reduce_async(self, tensors: Sequence[torch.Tensor], *, what: str, step: int) -> list[Any]:
        """Starts a SUM all-reduce of each tensor, in order; returns the work handles to `wait` for.

        A tensor the shared-memory group takes (`self.shared`: every worker on this host, a CPU tensor)
        is summed there and then, so it has no handle; the others start on the process group.
        """
        works = []
        for tensor in tensors:
            if self.shared is not None and self.shared.supports(tensor):
                self.shared.all_reduce_(tensor, what=what, step=step)
            else:
                works.append(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True))
        return works

    def all_reduce_(self, tensors: Sequence[torch.Tensor], *, what: str, step: int) -> None:
        """SUM all-reduce in place, waiting at most `timeout`."""
        self.wait(self.all_reduce_async(tensors, what=what, step=step), what=what, step=step)

    def connect_shared_memory(self, *, wanted: bool, why_not: str | None = None) -> tuple[str, bool]:
        """Every rank calls this once: sets `self.shared` when every worker runs on this host (and wants it).
        Returns the reason either way, in words, and whether the sums fell back to the process group although
        every worker runs on this host. `why_not`: this rank's own reason to stay on the process group."""
        from stratagem.collective import shared_memory

        # The meeting's store calls end within the timeout, whatever the chief's store does.
        store = self._store_calls.bounded(self.timeout + self.roll_call_seconds, "the shared-memory meeting")
        self.shared, reason, fell_back = shared_memory.connect(
            store, rank=self.rank, world_size=self.world_size, task_names=self.task_names, timeout=self.timeout,
            stall_warning_after=self.stall_warning_after, on_failure=self._failure, on_stall=self._warn_stall,
            why_not=why_not if wanted else shared_memory.TURNED_OFF)
        return reason, fell_back

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        self._store_calls.close()

    def wait(self, works: Sequence[Any], *, what: str, step: int) -> None:
        """Waits for work handles (None: a collective already done); raises an error naming the missing tasks
        on failure or timeout."""
        works = [w for w in works if w is not None]
        if not works:
            return
        if self.blocking_waits:
            self._wait_blocking(works, what, step)
            return
        futures = [w.get_future() for w in works]
        if all(f.done() for f in futures):
            self._raise_if_failed(futures, what, step)  # the common case: nothing to wait for
            return
        done = threading.Event()
        future = torch.futures.collect_all(futures)
        future.add_done_callback(lambda _: done.set())
        start = time.monotonic()
        if not done.wait(min(self.stall_warning_after, self.timeout)):
            self._warn_stall(what, step, start)
            if not done.wait(max(0.0, self.timeout - (time.monotonic() - start))):
                raise self._failure(what, step, None)
        self._raise_if_failed(futures, what, step)

    def _wait_blocking(self, works: Sequence[Any], what: str, step: int) -> None:
        """Each handle's own `wait(timeout)`: it raises when the time runs out (the handle not completed)
        and when the collective failed (completed, with the error)."""
        start = time.monotonic()
        warned = False
        for work in works:
            while True:
                limit = self.timeout if warned else min(self.stall_warning_after, self.timeout)
                try:
                    work.wait(timedelta(seconds=max(0.001, limit - (time.monotonic() - start))))
                    break
                except Exception as error:  # translated into an error that names the missing task
                    if work.is_completed():  # it failed; a handle still running only ran out of time
                        raise self._failure(what, step, error) from error
                    if warned or limit >= self.timeout:
                        raise self._failure(what, step, None) from None
                    self._warn_stall(what, step, start)
                    warned = True

    def _warn_stall(self, what: str, step: int, start: float) -> None:
        # The steps are read within what is left of the timeout, and no longer than the warning's own delay.
        left = self.timeout - (time.monotonic() - start)
        steps = self._format_steps(max(0.01, min(left, self.stall_warning_after)))
        logger.warning(
            "%s has waited %.0f s for the %s of step %d; steps reached: %s",
            self.task_name, time.monotonic() - start, what, step, steps,
        )

    def _raise_if_failed(self, futures: Sequence[Any], what: str, step: int) -> None:
        try:
            for result in futures:
                result.value()  # re-raises the error of a failed collective
        except Exception as error:  # noqa: BLE001 - translated into an error that names the missing task
            raise self._failure(what, step, error) from error

    # ---- failure reports ----------------------------------------------------------------------
    def _format_steps(self, seconds: float) -> str:
        try:
            steps = self.steps_reached(seconds)
        except CollectiveTimeoutError:
            return f"unknown (the chief's store, {self.task_names[0]}, did not answer within {seconds:g} s)"
        return ", ".join(f"{name}: {'-' if s is None else s}" for name, s in steps.items())

    def _failure(self, what: str, step: int, error: Exception | None) -> Exception:
        missing, store_ok = self._roll_call(step)
        cause = "timed out" if error is None else f"failed ({_first_line(error)})"
        if not store_ok:
            who = f"the chief ({self.task_names[0]}), which hosts the rendezvous store, is unreachable"
        elif missing:
            who = "lost: " + ", ".join(f"{self.task_names[r]} (rank {r})" for r in missing)
        else:
            who = "every task answered the roll call, so one is stuck rather than gone"
        message = (
            f"{self.task_name} (rank {self.rank}): the {what} of step {step} {cause} after waiting for the other "
            f"workers; {who}. Steps last reported: {self._format_steps(self.roll_call_seconds) if store_ok else 'unknown'}. Restart the job "
            "(stratagem launch --max-restarts restarts the group) and resume from the last checkpoint."
        )
        if error is None:
            return CollectiveTimeoutError(message)
        return ReplicaError(message)

    def _roll_call(self, step: int) -> tuple[list[int], bool]:
        """Which ranks are still alive: each survivor signs in, then reads who else did (within
        ``roll_call_seconds``, a store that does not answer meaning the chief is gone)."""
        deadline = time.monotonic() + self.roll_call_seconds

        def call(what: str, fn: Any, *args: Any) -> Any:
            return self._store_calls.run(what, fn, *args, seconds=max(0.05, deadline - time.monotonic()) + 1.0)

        try:
            call("the roll call", self.store.set, _ROLL_CALL.format(step=step, rank=self.rank), "here")
            keys = [_ROLL_CALL.format(step=step, rank=r) for r in range(self.world_size)]

            def absent() -> list[int]:
                return [r for r, key in enumerate(keys) if not self.store.check([key])]

            missing = call("the roll call", absent)
            while missing and time.monotonic() < deadline:
                try:
                    call("the roll call", self.store.wait, [keys[r] for r in missing],
                         timedelta(seconds=max(0.05, deadline - time.monotonic())))
                except CollectiveTimeoutError:
                    raise
                except Exception:  # noqa: BLE001 - a store wait that runs out just means someone is missing
                    pass
                missing = call("the roll call", absent)
            return missing, True
        except Exception:  # noqa: BLE001 - the store is gone (or stopped) with the chief
            return [0] if self.rank != 0 else [], False


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__
