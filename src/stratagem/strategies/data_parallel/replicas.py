"""Persistent replica threads and the barrier they meet at.

Replica 0 runs on the caller's thread; replicas 1..N-1 each own a thread that lives as long
as the strategy, so a step costs two hand-offs, not N thread start-ups. Every wait has a
timeout whose error names the replicas that did not arrive.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from stratagem.diagnose.placement import apply_placement, capture_placement
from stratagem.diagnose.soft_placement import as_placement_error
from stratagem.errors import CollectiveTimeoutError, ReplicaError
from stratagem.strategies.data_parallel.autocast import apply_autocast, capture_autocast


class _Aborted(Exception):
    """Raised in a replica whose step was abandoned because another replica failed."""


class ReplicaBarrier:
    """Where the replicas of one process meet (end of backward, after combining gradients).

    It fails fast, instead of waiting out its timeout, when a replica has failed or has
    returned from the step function without arriving.
    """

    def __init__(self, names: Sequence[str], timeout: float) -> None:
        self._names = list(names)
        self._timeout = timeout
        self._cond = threading.Condition()
        self._arrived: set[int] = set()
        self._finished: set[int] = set()
        self._generation = 0
        self._what = ""
        self._error: BaseException | None = None
        self._stealers = 0  # replicas waiting here with a `steal` callback (at the end of backward)

    def reset(self) -> None:
        with self._cond:
            self._arrived.clear()
            self._finished.clear()
            self._error = None

    def abort(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def finish(self, replica: int) -> None:
        """Records that `replica` returned from the step function (it will not arrive any more)."""
        with self._cond:
            self._finished.add(replica)
            self._cond.notify_all()

    def notify(self, update: Callable[[], None] | None = None) -> None:
        """Runs `update` under the barrier's lock (the one `steal` callbacks run under), then wakes the
        replicas waiting here with a `steal` callback, so that it can look again for work. A replica waiting
        without one (at a BatchNorm meeting in the middle of backward) is left asleep: woken, it would only
        find its meeting unfinished, after taking a core and Python's global lock from the replicas it waits
        for."""
        with self._cond:
            if update is not None:
                update()
            if self._stealers:
                self._cond.notify_all()

    def wait(
        self,
        replica: int,
        what: str,
        step: int,
        steal: Callable[[], Callable[[], None] | None] | None = None,
        call: str | None = None,
        last: Callable[[], None] | None = None,
    ) -> None:
        """Waits until every replica has arrived (or one has failed, returned, or timed out).

        `steal`, called with the barrier's lock held while this replica waits, may hand back a job
        to run with the lock released (work another replica would otherwise do after the meeting);
        what it claims is decided before the last replica arrives, never after. `call`: what the user
        calls to get here (for the error when a replica returned without arriving). `last` runs once,
        on the last replica to arrive, before any is released (what the meeting computes for all of them, so
        the others wake to it); when it raises, every replica of the meeting fails with its error.
        """
        n = len(self._names)
        with self._cond:
            if self._error is not None:
                raise _Aborted() from self._error
            generation = self._generation
            if replica in self._arrived:
                # The same replica twice in one meeting: another replica's thread ran this replica's modules.
                raise self._fail(self._twice(replica, what, step, self._arrived))
            if not self._arrived:
                self._what = what
            elif what != self._what:
                # Two different meetings would otherwise be taken for one (a replica ran another path).
                raise self._fail(self._elsewhere(replica, what, step, sorted(self._arrived), self._what))
            self._arrived.add(replica)
            if len(self._arrived) == n:
                if last is not None:
                    try:
                        last()
                    except BaseException as exc:
                        self._error = exc
                        self._cond.notify_all()
                        raise
                self._arrived.clear()
                self._generation += 1
                self._cond.notify_all()
                return
            deadline = time.monotonic() + self._timeout
            if steal is not None:
                self._stealers += 1
            try:
                self._wait(generation, replica, what, step, steal, call, deadline)
            finally:
                if steal is not None:
                    self._stealers -= 1

    def _wait(
        self,
        generation: int,
        replica: int,
        what: str,
        step: int,
        steal: Callable[[], Callable[[], None] | None] | None,
        call: str | None,
        deadline: float,
    ) -> None:
        """The wait of `wait` for a replica that is not the last to arrive, with the barrier's lock held."""
        while generation == self._generation:
            if self._error is not None:
                raise _Aborted() from self._error
            gone = sorted(self._finished - self._arrived)
            if gone:
                raise self._fail(self._gone(replica, what, step, gone, call))
            job = steal() if steal is not None else None
            if job is not None:
                self._cond.release()  # the job runs while the others may arrive
                try:
                    job()
                finally:
                    self._cond.acquire()
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._fail(self._timed_out(replica, what, step, self._arrived))
            self._cond.wait(remaining)

    def check_elsewhere(
        self,
        replica: int,
        what: str,
        step: int,
        arrived: Sequence[int],
        *,
        their_what: str | None = None,
        twice: bool = False,
        failed: bool = False,
        waited: float = 0.0,
    ) -> None:
        """For a meeting held outside this barrier (exact BatchNorm's native meeting, batch_norm_native.py), where
        `replica` waits at `what` with `arrived` there: raises what this barrier's own wait would, when anything
        is wrong (a replica failed, arrived twice, waits at another meeting here or there (`their_what`), returned
        without arriving, or `waited` reached the timeout); returns when nothing is. `failed`: the meeting
        itself saw another replica fail there, which always raises."""
        with self._cond:
            if self._error is not None:
                raise _Aborted() from self._error
            if twice:
                raise self._fail(self._twice(replica, what, step, arrived))
            if their_what is not None and their_what != what:
                raise self._fail(self._elsewhere(replica, what, step, [r for r in arrived if r != replica], their_what))
            if self._arrived:
                raise self._fail(self._elsewhere(replica, what, step, sorted(self._arrived), self._what))
            gone = sorted(self._finished - set(arrived))
            if gone:
                raise self._fail(self._gone(replica, what, step, gone, "the model (and backward())"))
            if waited >= self._timeout:
                raise self._fail(self._timed_out(replica, what, step, arrived))
            if failed:
                others = self._describe([r for r in range(len(self._names)) if r != replica])
                raise self._fail(ReplicaError(f"The {what} of step {step} failed on {others}; see its error."))

    # ---- the errors of a meeting --------------------------------------------------------------------------
    def _missing(self, arrived: Collection[int]) -> list[int]:
        return sorted(set(range(len(self._names))) - set(arrived))

    def _twice(self, replica: int, what: str, step: int, arrived: Collection[int]) -> ReplicaError:
        return ReplicaError(
            f"Replica {replica} ({self._names[replica]}) reached the {what} of step {step} a second time "
            f"while {self._describe(self._missing(arrived))} never did: another replica ran replica {replica}'s "
            "parameters. Received: replica copies that share a submodule, typically through a function "
            "kept as an attribute (a lambda or a function from outside the model) that calls the "
            "original's submodule. Define a method on the module instead, which each copy binds to itself."
        )

    def _elsewhere(self, replica: int, what: str, step: int, others: Sequence[int], their_what: str) -> ReplicaError:
        return ReplicaError(
            f"Replica {replica} ({self._names[replica]}) reached the {what} of step {step}, but "
            f"{self._describe(others)} wait(s) at the {their_what}. Every replica must run the "
            "same model calls and backward() passes in each step, whatever its slice."
        )

    def _gone(self, replica: int, what: str, step: int, gone: Sequence[int], call: str | None) -> ReplicaError:
        # The meeting points of an update are reached through optimizer.step(), the others through backward().
        if call is None:
            call = (
                "optimizer.step()"
                if "optimizer step" in what
                else "scheduler.step()"
                if "scheduler step" in what
                else "backward()"
            )
        return ReplicaError(
            f"Replica {replica} ({self._names[replica]}) is waiting at the {what} of step {step}, but "
            f"{self._describe(gone)} returned from the step function without getting there. Every "
            f"replica must call {call} the same number of times in each step, even on an empty slice."
        )

    def _timed_out(self, replica: int, what: str, step: int, arrived: Collection[int]) -> CollectiveTimeoutError:
        return CollectiveTimeoutError(
            f"Timed out after {self._timeout:g} s at the {what} of step {step}: replica {replica} "
            f"({self._names[replica]}) was waiting for {self._describe(self._missing(arrived))}. A replica is stuck or "
            "much slower than the others; raise `timeout=` on the strategy if this step is legitimately slow."
        )

    def _fail(self, error: BaseException) -> BaseException:
        """With the lock held: the meeting fails with `error` for every replica (woken to see it); returned to raise."""
        self._error = error
        self._cond.notify_all()
        return error

    def _describe(self, replicas: Sequence[int]) -> str:
        names = ", ".join(f"replica {r} ({self._names[r]})" for r in replicas)
        return names


class ReplicaPool:
    """Runs a job once per replica, replica r on its own persistent thread (replica 0 on the caller's).

    `setup(r)` runs once on each replica's thread when it starts (device, intra-op threads).
    """

    def __init__(self, names: Sequence[str], setup: Callable[[int], None], timeout: float) -> None:
        self._names = list(names)
        self._timeout = timeout
        self._inboxes: list[queue.SimpleQueue] = []
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._generation = 0
        for r in range(1, len(names)):
            inbox: queue.SimpleQueue = queue.SimpleQueue()
            thread = threading.Thread(
                target=self._serve, args=(r, inbox, setup), name=f"stratagem-replica-{r}", daemon=True
            )
            self._inboxes.append(inbox)
            self._threads.append(thread)
            thread.start()

    def _serve(self, replica: int, inbox: queue.SimpleQueue, setup: Callable[[int], None]) -> None:
        setup(replica)
        while True:
            item = inbox.get()
            if item is None:
                return
            generation, job, placement, autocast = item
            try:
                # The caller's placement log / soft placement and autocast, if any: all thread-local in torch.
                with apply_placement(placement), apply_autocast(autocast):
                    result = job(replica)
                self._outbox.put((generation, replica, True, result))
            except BaseException as error:  # noqa: BLE001 - handed to the caller's thread, which re-raises it
                self._outbox.put((generation, replica, False, error))

    def run(self, job: Callable[[int], Any], on_error: Callable[[BaseException], None]) -> list[Any]:
        """Runs `job(r)` for every replica; returns the results in replica order.

        The first exception raised by a replica (in time) is re-raised here, after every other
        replica has stopped; `on_error` is called as soon as it happens so that replicas waiting
        at a barrier give up at once.
        """
        self._generation += 1
        generation = self._generation
        placement = capture_placement()  # None unless a placement log or soft placement is active
        autocast = capture_autocast()  # None unless the caller entered torch.autocast
        for inbox in self._inboxes:
            inbox.put((generation, job, placement, autocast))
        results: list[Any] = [None] * len(self._names)
        errors: list[tuple[int, BaseException]] = []
        try:
            results[0] = job(0)
        except BaseException as replica_0_error:  # noqa: BLE001 - re-raised below with the others
            errors.append((0, replica_0_error))
            on_error(replica_0_error)
        deadline = time.monotonic() + self._timeout
        pending = set(range(1, len(self._names)))
        while pending:
            try:
                item_generation, replica, ok, value = self._outbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                stuck = ", ".join(f"replica {r} ({self._names[r]})" for r in sorted(pending))
                if errors:
                    break  # the first error says more than "still running"; the stuck replicas are abandoned
                raise CollectiveTimeoutError(
                    f"Timed out after {self._timeout:g} s waiting for {stuck} to return from the step function. "
                    "Raise `timeout=` on the strategy if a step is legitimately this slow."
                ) from None
            if item_generation != generation:
                continue  # a late result of an earlier, abandoned run
            pending.discard(replica)
            if ok:
                results[replica] = value
            else:
                errors.append((replica, value))
                on_error(value)
        if errors:
            real = [(r, e) for r, e in errors if not isinstance(e, _Aborted)]
            replica, error = (real or errors)[0]
            if isinstance(error, _Aborted) and error.__cause__ is not None:
                error = error.__cause__
            from stratagem.strategies.data_parallel.amp import shared_scaler_error  # here: amp imports this module

            # torch's "Could not run ... backend", or a GradScaler shared by the replicas, with the fix.
            translated = as_placement_error(error) or shared_scaler_error(error)
            if translated is not None:
                translated.__cause__ = error
                error = translated
            if hasattr(error, "add_note") and not isinstance(error, (CollectiveTimeoutError, ReplicaError)):
                error.add_note(f"(raised in replica {replica} on {self._names[replica]})")
            raise error
        return results

    def close(self) -> None:
        for inbox in self._inboxes:
            inbox.put(None)
        for thread in self._threads:
            thread.join(timeout=self._timeout)
