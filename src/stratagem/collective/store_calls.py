"""Calls on the chief's TCP store, each waited for at most a given time.

torch's ``TCPStore`` client waits without a bound in some calls (``check``, ``get`` and ``set`` on a
chief that is stopped but still holds its connections: measured, over 60 s against a 3 s store
timeout). The calls go through one daemon thread here and the caller waits for each at most the
time it gives; a call still stuck inside torch is left there, and until it returns every further
call is refused at once (they would queue behind it on the same connection).

    >>> calls = StoreCalls(store, chief="worker:0")
    >>> calls.run("the steps reached", store.check, ["stratagem/step/1"], seconds=5.0)   # doctest: +SKIP
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from stratagem.errors import CollectiveTimeoutError

T = TypeVar("T")
_STOP: Any = object()


class StoreCalls:
    """Runs store calls on one daemon thread; ``run`` waits for each at most ``seconds``."""

    def __init__(self, store: Any, *, chief: str, caller: str = "this task") -> None:
        self.store = store
        self.chief = chief
        self.caller = caller
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stuck: tuple[str, Future[Any]] | None = None

    def run(self, what: str, fn: Callable[..., T], *args: Any, seconds: float) -> T:
        """``fn(*args)`` (a call on the store), or ``CollectiveTimeoutError`` naming the chief when it has not
        returned within ``seconds``; an error of the call itself is raised as it is."""
        with self._lock:
            if self._stuck is not None:
                earlier, pending = self._stuck
                if not pending.done():
                    raise self._error(what, f"an earlier call ({earlier}) has not returned yet", seconds)
                self._stuck = None
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, daemon=True, name="stratagem-store-calls")
                self._thread.start()
            future: Future[T] = Future()
            self._queue.put((fn, args, future))
        try:
            return future.result(timeout=max(0.0, seconds))
        except FutureTimeout:
            with self._lock:
                self._stuck = (what, future)
            raise self._error(what, f"no answer within {seconds:g} s", seconds) from None

    def bounded(self, seconds: float, what: str) -> BoundedStore:
        """The store as an object with its ``set``/``get``/``check``/``multi_get``/``wait``, every call through
        ``run`` and all of them within ``seconds`` from now (for code that takes a store, such as the
        shared-memory meeting)."""
        return BoundedStore(self, time.monotonic() + seconds, what)

    def close(self) -> None:
        """Ends the thread (at once when it is idle; one stuck in a store call is left to end with the process).
        A later ``run`` starts another."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(_STOP)
        if thread is not None:
            thread.join(timeout=1.0)
        # A client of the chief's store, whose connection ends with its last reference (the listening store
        # belongs to the worker group, which frees the port at close()).
        self.store = None

    def _error(self, what: str, received: str, seconds: float) -> CollectiveTimeoutError:
        return CollectiveTimeoutError(
            f"{self.caller}: the chief ({self.chief}, rank 0), which hosts the rendezvous store, did not answer "
            f"{what}. Received: {received}. Check that {self.chief} is running and not stopped or overloaded; "
            "restart the job (it resumes from the last checkpoint), or raise the timeout."
        )

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, args, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
                future.set_exception(exc)


class BoundedStore:
    """A store whose calls all end by one deadline (``StoreCalls.bounded``)."""

    def __init__(self, calls: StoreCalls, deadline: float, what: str) -> None:
        self._calls = calls
        self._deadline = deadline
        self._what = what

    def _run(self, name: str, *args: Any) -> Any:
        return self._calls.run(
            f"{self._what} ({name})",
            getattr(self._calls.store, name),
            *args,
            seconds=max(0.01, self._deadline - time.monotonic()),
        )

    def set(self, key: str, value: str) -> None:
        self._run("set", key, value)

    def get(self, key: str) -> bytes:
        return self._run("get", key)

    def check(self, keys: list[str]) -> bool:
        return self._run("check", keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._run("multi_get", keys)

    def wait(self, keys: list[str], timeout: Any) -> None:
        self._run("wait", keys, timeout)
