"""``ClusterCoordinator``: the chief schedules functions on workers, as tf.distribute's coordinator does.

    strategy = sg.ParameterServerStrategy()
    model, optimizer = strategy.distribute(Net(), torch.optim.Adam(...))
    coordinator = sg.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(make_dataset))   # make_dataset: module level

    def train_step(iterator):                  # module level: workers find it by name
        x, y = next(iterator)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()                       # pushes the gradients to the parameter servers
        optimizer.zero_grad()
        return loss

    losses = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(100)]
    coordinator.join()
    print([loss.fetch() for loss in losses])

``schedule`` never blocks: it queues the function and returns a ``RemoteValue``. One thread per
worker takes functions from the queue and runs them there, one at a time. A ``RemoteValue`` can
be an argument of a later function: its result is fetched first and sent along. ``join`` waits for
everything scheduled; ``done`` polls; ``fetch`` waits for values. The first error raised by a
scheduled function is re-raised by ``join``, ``done``, ``fetch`` and ``schedule``; the functions
still queued are cancelled (their values raise the same error); after ``join`` has raised it the
coordinator can be used again.

Faults: a worker that cannot be reached (it died) or that stops answering (stopped with SIGSTOP, cut
off the network, wedged: no answer to its heartbeat, a ping every ``heartbeat_interval`` seconds, for
``heartbeat_timeout`` seconds; see ``heartbeat``) gives its in-flight function back to the queue, so
another worker runs it (at least once; a function can run twice if the worker applied its update
before it was lost, or resumes after it); the worker's thread then waits up to
``worker_recovery_timeout`` for it to answer again (a restarted task on the same address, a stopped one
continued) and takes it back; a worker that does not come back is dropped, and if no worker is left
the coordinator fails naming them. A function that runs longer than ``closure_timeout`` on a worker
that still answers its heartbeat fails the job (the function itself is stuck, not its worker); when the
call runs out, the coordinator waits for the heartbeat's next answer or its finding the worker hung
(``Heartbeat.verdict``), so a worker stopped mid-call is lost, whichever timeout is shorter. A
parameter server that cannot be reached is an error naming it (``ps:0``), raised at once: the job is
then restarted and resumes from its last checkpoint (``strategy.save`` / ``strategy.restore``).

On a worker task the same script reaches ``schedule`` (or ``join``/``done``/``fetch``) and serves
there until the chief ends the job, then exits (``SystemExit(0)``).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from stratagem.errors import CollectiveTimeoutError, InputError, ParameterServerError
from stratagem.strategies.parameter_server import functions
from stratagem.strategies.parameter_server.heartbeat import (
    CLOSURE_TIMEOUT,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    WORKER_RECOVERY_TIMEOUT,
    Heartbeat,
    WorkerFault,
)
from stratagem.strategies.parameter_server.tracing import closure_args
from stratagem.strategies.parameter_server.transport import Client, task_lost
from stratagem.strategies.parameter_server.worker import SERVICE as WORKER_SERVICE
from stratagem.timeouts import check_optional_seconds, check_seconds

if TYPE_CHECKING:
    from stratagem.strategies.parameter_server.tasks import ParameterServerTasks

logger = logging.getLogger(__name__)


class RemoteValue:
    """The future result of one scheduled function (tf.distribute's ``RemoteValue``)."""

    def __init__(self, name: str, timeout: float) -> None:
        self._name = name
        self._timeout = timeout
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _set(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._event.set()

    def done(self) -> bool:
        """True once the function has finished (or failed, or was cancelled)."""
        return self._event.is_set()

    def fetch(self, timeout: float | None = None) -> Any:
        """Waits for the result and returns it; re-raises the function's error (or the one that cancelled it)."""
        wait = self._timeout if timeout is None else check_seconds("timeout", timeout)
        if not self._event.wait(wait):
            raise CollectiveTimeoutError(
                f"{self._name} has no result after {wait:g} s. Received: it is still queued "
                "or running. Call coordinator.join() first, or pass a longer timeout."
            )
        if self._error is not None:
            raise self._error
        return self._value

    get = fetch

    def __repr__(self) -> str:
        return f"RemoteValue({self._name}, done={self.done()})"


class PerWorkerDataset:
    """A dataset built on each worker by ``dataset_fn`` (called there with no argument)."""

    _ids = itertools.count()

    def __init__(self, fn_ref: dict[str, Any]) -> None:
        self.id = f"dataset-{next(self._ids)}"
        self.fn_ref = fn_ref

    def __iter__(self) -> PerWorkerIterator:
        return PerWorkerIterator(self)


class PerWorkerIterator:
    """Stands for each worker's own iterator over its ``PerWorkerDataset``; pass it to ``schedule``."""

    def __init__(self, dataset: PerWorkerDataset) -> None:
        self.dataset = dataset

    def __next__(self) -> Any:
        raise InputError(
            "A per-worker iterator is read on the workers. Received: next() on the chief. "
            "Pass it to coordinator.schedule(fn, args=(iterator,)) and call next() in fn."
        )


class _Closure:
    def __init__(
        self,
        number: int,
        fn: Callable[..., Any],
        fn_ref: dict[str, Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        timeout: float,
    ) -> None:
        self.number = number
        self.name = f"{getattr(fn, '__qualname__', 'function')} #{number}"
        self.fn_ref, self.args, self.kwargs = fn_ref, args, kwargs
        self.value = RemoteValue(self.name, timeout)
        self.attempts = 0


def _iterator_ref(datasets: dict[str, Any]) -> Callable[[Any], Any]:
    def ref(value: Any) -> Any:
        if isinstance(value, PerWorkerDataset):
            value = iter(value)
        if isinstance(value, PerWorkerIterator):
            datasets[value.dataset.id] = value.dataset.fn_ref
            return {"$iter": value.dataset.id}
        return None

    return ref


def _fetched(value: Any) -> Any:
    """``value`` with every ``RemoteValue`` in it replaced by its result (waits for each)."""
    if isinstance(value, RemoteValue):
        return value.fetch()
    if isinstance(value, (list, tuple)):
        return type(value)(_fetched(v) for v in value)
    if isinstance(value, dict):
        return {k: _fetched(v) for k, v in value.items()}
    return value


class ClusterCoordinator:
    """Schedules functions on the workers of a ``ParameterServerStrategy`` (see the module docstring)."""

    def __init__(
        self,
        strategy: ParameterServerTasks,
        *,
        worker_recovery_timeout: float = WORKER_RECOVERY_TIMEOUT,
        closure_timeout: float = CLOSURE_TIMEOUT,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
    ) -> None:
        self.strategy = strategy
        self.worker_recovery_timeout = check_seconds("worker_recovery_timeout", worker_recovery_timeout)
        self.closure_timeout = check_seconds("closure_timeout", closure_timeout)
        self.heartbeat_interval = check_seconds("heartbeat_interval", heartbeat_interval)
        self.heartbeat_timeout = check_seconds("heartbeat_timeout", heartbeat_timeout)
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise InputError(
                "heartbeat_timeout must be longer than heartbeat_interval, or a worker counts as hung between two "
                f"pings. Received: heartbeat_interval={heartbeat_interval!r}, heartbeat_timeout={heartbeat_timeout!r}. "
                "Pass a heartbeat_timeout of several intervals (the defaults: 2 s and 10 s)."
            )
        self.faults: list[WorkerFault] = []
        """Every loss of a worker so far, in order (``WorkerFault``: the task, hung or unreachable, when)."""
        self._numbers = itertools.count()
        self._queue: collections.deque[_Closure] = collections.deque()
        self._cv = threading.Condition()
        self._inflight = 0
        self._error: BaseException | None = None
        self._closed = False
        self._lost: list[str] = []
        self._threads: list[threading.Thread] = []
        self._heartbeats: list[Heartbeat] = []
        strategy.coordinator_timeouts = self.timeouts()
        if not strategy.tasks.is_coordinator:
            return  # a worker task: schedule() serves instead
        for task, address in strategy.tasks.workers:
            client = Client(address, WORKER_SERVICE, security=strategy.tasks.security, task=task)
            beat = Heartbeat(
                Client(address, WORKER_SERVICE, security=strategy.tasks.security, task=task),
                interval=self.heartbeat_interval,
                timeout=self.heartbeat_timeout,
            )
            thread = threading.Thread(
                target=self._dispatch, args=(client, beat), name=f"coordinator-{task}", daemon=True
            )
            self._threads.append(thread)
            self._heartbeats.append(beat)
            beat.start()
            thread.start()
        strategy.on_shutdown(self._close)

    def timeouts(self) -> dict[str, float]:
        """The seconds this coordinator waits, by argument name (``strategy.explain()`` states them)."""
        return {
            "heartbeat_interval": self.heartbeat_interval,
            "heartbeat_timeout": self.heartbeat_timeout,
            "worker_recovery_timeout": self.worker_recovery_timeout,
            "closure_timeout": self.closure_timeout,
        }

    @property
    def num_workers(self) -> int:
        """Workers that take scheduled functions (lost ones no longer count)."""
        return len(self._threads) - len(self._lost)

    # ---- user API ----------------------------------------------------------------------------
    def create_per_worker_dataset(self, dataset_fn: Callable[[], Any]) -> PerWorkerDataset:
        """A dataset made on every worker by calling ``dataset_fn()`` there (a module-level function)."""
        return PerWorkerDataset(functions.function_ref(dataset_fn, local_ok=self.strategy.tasks.workers_in_process))

    def schedule(
        self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> RemoteValue:
        """Queues ``fn(*args, **kwargs)`` for a worker and returns its ``RemoteValue`` at once.

        Example:
            >>> loss = coordinator.schedule(train_step, args=(iterator,))   # doctest: +SKIP
        """
        if not self.strategy.tasks.is_coordinator:
            self.strategy.serve_as_worker()
        kwargs = dict(kwargs or {})
        fn_ref = functions.function_ref(fn, local_ok=self.strategy.tasks.workers_in_process)
        # Refuse values that cannot travel now, before any work starts (RemoteValues are resolved later).
        checker = functions.Encoder(
            lambda v: {} if isinstance(v, (RemoteValue, PerWorkerIterator, PerWorkerDataset)) else None
        )
        checker.encode(tuple(args), "args")
        checker.encode(kwargs, "kwargs")
        started = self.strategy.tracing.now()
        with self._cv:
            self._raise_error(clear=False)
            if self._closed:
                raise InputError(
                    "The coordinator is shut down. Received: a schedule() after "
                    "strategy.shutdown(). Schedule before shutting down."
                )
            closure = _Closure(next(self._numbers), fn, fn_ref, tuple(args), kwargs, self.closure_timeout)
            self._queue.append(closure)
            self._inflight += 1
            self._cv.notify_all()
        self.strategy.tracing.scheduled(closure_args(closure), started)
        return closure.value

    def join(self, timeout: float | None = None) -> None:
        """Waits until every scheduled function has finished; re-raises the first error (once)."""
        timeout = check_optional_seconds("timeout", timeout)
        if not self.strategy.tasks.is_coordinator:
            self.strategy.serve_as_worker()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._inflight and self._error is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise CollectiveTimeoutError(
                        f"join() timed out after {timeout:g} s. Received: {self._inflight} functions still queued or "
                        f"running on {self.num_workers} workers. Wait longer, or check the workers' logs."
                    )
                self._cv.wait(remaining)
            self._raise_error(clear=True)

    def done(self) -> bool:
        """True when nothing scheduled is left; re-raises the first error."""
        if not self.strategy.tasks.is_coordinator:
            self.strategy.serve_as_worker()
        with self._cv:
            self._raise_error(clear=True)
            return self._inflight == 0

    def fetch(self, values: Any) -> Any:
        """The results of a structure of ``RemoteValue``s (waits for each)."""
        if not self.strategy.tasks.is_coordinator:
            self.strategy.serve_as_worker()
        return _fetched(values)

    # ---- inside ------------------------------------------------------------------------------
    def _raise_error(self, *, clear: bool) -> None:
        error = self._error
        if error is not None:
            if clear:
                self._error = None
            raise error

    def _fail(self, error: BaseException, closure: _Closure | None) -> None:
        """Records the first error and cancels every queued function (called with ``_cv`` held)."""
        if closure is not None:
            closure.value._set(error=error)
            self._inflight -= 1
        if self._error is None:
            self._error = error
        while self._queue:
            self._queue.popleft().value._set(error=error)
            self._inflight -= 1
        self._cv.notify_all()

    def _next(self) -> _Closure | None:
        with self._cv:
            while not self._queue and not self._closed:
                self._cv.wait()
            return None if self._closed else self._queue.popleft()

    def _finish(self, closure: _Closure, value: Any) -> None:
        with self._cv:
            closure.value._set(value)
            self._inflight -= 1
            self._cv.notify_all()

    def _dispatch(self, client: Client, beat: Heartbeat) -> None:
        """One worker's thread: take a function, run it there, record the result; survive the worker's loss."""
        try:
            while True:
                closure = self._next()
                if closure is None:
                    return
                started = self.strategy.tracing.now()
                try:
                    if beat.hung:  # lost while idle: no call, the function goes back at once
                        raise _Hung()
                    self.strategy.tracing.worker_ready(client)  # a trace that records starts on this worker first
                    reply = self._run_on(client, closure, beat)
                except (ParameterServerError, _Hung) as exc:
                    if not (isinstance(exc, _Hung) or task_lost(exc) or beat.hung):
                        with self._cv:
                            self._fail(exc, closure)
                        continue
                    back = self._requeue_and_wait(client, beat, closure)
                    if back is None:  # the coordinator was shut down meanwhile
                        return
                    if not back:
                        self._lose(client)
                        return
                    logger.warning("%s is back and takes functions again", client.task)
                    continue
                except Exception as exc:  # noqa: BLE001 - a value that cannot travel: fail the job clearly
                    with self._cv:
                        self._fail(exc, closure)
                    continue
                self._record(closure, client, reply)
                self.strategy.tracing.dispatched(client.task, closure_args(closure), started)
        finally:
            client.close()

    def _requeue_and_wait(self, client: Client, beat: Heartbeat, closure: _Closure) -> bool | None:
        """Gives ``closure`` back to the queue, records the fault and waits for the worker (``_wait_for_return``)."""
        if self._closed:  # its call was cut by strategy.shutdown() (Heartbeat.stop): the job ended, not the worker
            return None
        answers = beat.answers()  # an answer after this one means the worker is back
        with self._cv:
            self._queue.appendleft(closure)  # another worker (or this one, back) runs it again
            self._cv.notify_all()
        hung = beat.hung
        fault = WorkerFault(client.task, "hung" if hung else "unreachable", beat.silent_for(), time.monotonic())
        with self._cv:
            self.faults.append(fault)
        logger.warning(
            "%s %s; %s goes back to the queue; waiting up to %g s for it to return",
            client.task,
            f"hung (no heartbeat answer for {fault.silent_s:.1f} s)" if hung else "unreachable",
            closure.name,
            self.worker_recovery_timeout,
        )
        return self._wait_for_return(beat, answers)

    def _too_long(self, closure: _Closure, client: Client, beat: Heartbeat, exc: Exception) -> Exception:
        return CollectiveTimeoutError(
            f"{closure.name} ran longer than closure_timeout={self.closure_timeout:g} s on {client.task}, which "
            f"still answers its heartbeat (last answer {beat.silent_for():.1f} s ago), so the function itself is "
            f"slow or stuck. Received: {exc} Pass a longer closure_timeout to ClusterCoordinator, or find what the "
            "function waits for (the worker's log)."
        )

    def _record(self, closure: _Closure, client: Client, reply: tuple[str, Any, dict[str, Any]]) -> None:
        """Sets ``closure``'s value from the worker's reply (its result, or the error it raised)."""
        op, meta, tensors = reply
        if op == "result":
            try:
                value = functions.decode(meta["value"], tensors)
            except ParameterServerError as exc:
                with self._cv:
                    self._fail(exc, closure)
                return
            self._finish(closure, value)
        else:
            where = f"{closure.name} on {client.task}"
            if meta.get("ps_lost"):
                error: BaseException = ParameterServerError(
                    f"Parameter server {meta['ps_lost']} was lost while {where} ran. Received: "
                    f"{meta.get('message')}. Restart the job; it resumes from the last checkpoint "
                    "(strategy.save / strategy.restore)."
                )
            else:
                error = functions.rebuild_error(meta, where)
            with self._cv:
                self._fail(error, closure)

    def _wait_for_return(self, beat: Heartbeat, answers: int) -> bool | None:
        """True once a lost worker answers its heartbeat again (more than ``answers`` pings answered), False after
        ``worker_recovery_timeout`` without it, None as soon as the coordinator is shut down (its thread then
        ends instead of waiting on)."""
        deadline = time.monotonic() + self.worker_recovery_timeout
        while not self._closed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if beat.wait_answer(answers, min(0.5, remaining)):
                return True
        return None

    def _run_on(self, client: Client, closure: _Closure, beat: Heartbeat) -> tuple[str, Any, dict[str, Any]]:
        datasets: dict[str, Any] = {}
        encoder = functions.Encoder(_iterator_ref(datasets))
        args = _fetched(list(closure.args))
        kwargs = _fetched(closure.kwargs)
        meta = {
            "fn": closure.fn_ref,
            "args": encoder.encode(args, "args"),
            "kwargs": encoder.encode(kwargs, "kwargs"),
            "datasets": datasets,
        }
        closure.attempts += 1
        meta["closure"] = closure_args(closure)
        try:
            return client.call(
                "Run", "run", meta, encoder.tensors, timeout=self.closure_timeout, cancellation=beat.cancellation
            )
        except CollectiveTimeoutError as exc:
            # The heartbeat's last answer may predate a freeze that also explains the timeout (SIGSTOP mid-call,
            # before heartbeat_timeout of silence): only an answer from now on shows that the function is stuck.
            if beat.verdict():
                raise self._too_long(closure, client, beat, exc) from None
            raise _Hung() from None

    def _lose(self, client: Client) -> None:
        with self._cv:
            self._lost.append(client.task)
            if len(self._lost) == len(self._threads):
                kinds = {fault.task: fault.kind for fault in self.faults}
                named = ", ".join(f"{task} ({kinds.get(task, 'unreachable')})" for task in self._lost)
                self._fail(
                    ParameterServerError(
                        f"Every worker was lost. Received: {named} did not answer again within "
                        f"worker_recovery_timeout={self.worker_recovery_timeout:g} s (hung: no heartbeat answer for "
                        f"heartbeat_timeout={self.heartbeat_timeout:g} s; unreachable: its port refused calls). "
                        "Restart the workers (same TF_CONFIG) or the job; it resumes from the last checkpoint."
                    ),
                    None,
                )
        logger.error(
            "%s did not come back within %g s; it gets no more functions", client.task, self.worker_recovery_timeout
        )

    def _close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for beat in self._heartbeats:
            beat.stop()


class _Hung(Exception):
    """A worker found hung by its heartbeat before its function was sent, or after its call ran out of time."""
