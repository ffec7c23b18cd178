"""The trace of a parameter-server job (`stratagem.trace`, docs/trace.md): each scheduled function on the worker
that ran it, with its pulls and pushes to each parameter server, each server's updates, and the chief's schedules
and dispatches.

The chief drives it. `TraceSession.begin` starts the chief's own recorder; each worker is started before the first
function dispatched to it while the trace is on, each parameter server as soon as the model is placed (the servers
are up by then). Both are started through the task's `Trace` method (`TaskTrace.handle`): the chief first times 16
round trips of its `clock` request and keeps the one of least delay (`clocks.measure`, NTP's rule, as `clocks.align`
does through a store), then sends `start` with that offset, the directory and the task's place in the trace.
`TraceSession.end` sends `stop` to every task started, which writes its own file and replies once it is written, and
then writes the chief's: when `end` returns, every file is there (a task lost meanwhile is named in a warning).

The processes of the trace: `worker:<i>` (rank i, `worker-<i>.json`), `ps:<j>` (rank num_workers + j,
`ps-<j>.json`) and a chief task of its own (the last rank, `chief.json`); a worker that coordinates (`stratagem
launch`, no chief task) holds the chief's tracks in its own process. A worker's tracks: `functions` (each function,
its forward, its optimizer step, a `wait` for each pull and push) and `transport: ps:<j>` (each pull from and push
to that server: bytes, gRPC or shared memory). A server's: `updates` (each push applied). The chief's: the
scheduling thread's (`schedule` of each function) and `dispatch worker:<i>` (each function sent to that worker, from
the queue to its result). A flow arrow joins each dispatch to the function it ran.

    >>> session = TraceSession(plan, ps_service=server.SERVICE, rpc_timeout=60.0)
    >>> session.begin("traces/"); ...; session.end()        # traces/worker-0.json, worker-1.json, ps-0.json, ...
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from stratagem.errors import CollectiveTimeoutError, InputError, ParameterServerError
from stratagem.strategies.parameter_server.partitioners import Shard, shard_of
from stratagem.strategies.parameter_server.transport import Client, Reply, Security
from stratagem.trace.clocks import measure
from stratagem.trace.recorder import Clock, Recorder, spanning

logger = logging.getLogger(__name__)

FUNCTIONS = "functions"
"""A worker's track of the functions it ran (they run one at a time, each on some gRPC thread)."""
UPDATES = "updates"
"""A parameter server's track of the pushes it applied (one at a time, under its lock)."""
START_TIMEOUT = 10.0
"""Seconds each request that starts a task's trace may take (a task that does not answer goes untraced)."""


class TaskTrace:
    """One task's recorder, and the `Trace` method through which the chief starts and stops it."""

    def __init__(self, task: str, recorder: Recorder | None = None) -> None:
        self.recorder = recorder if recorder is not None else Recorder(rank=0, task=task)
        self._directory: str | None = None
        self._lock = threading.Lock()

    def handle(self, op: str, meta: Any, tensors: Mapping[str, torch.Tensor]) -> Reply:
        """The `Trace` method: `clock` (this task's time now), `start`, `stop` (writes the file; replies its path)."""
        recorder = self.recorder
        if op == "clock":
            return "clock", {"ns": recorder.now()}, {}
        with self._lock:
            if op == "start":
                if not recorder.on:
                    recorder.clear()
                    recorder.rank, recorder.role, recorder.file_name = meta["rank"], meta["role"], meta["file"]
                    recorder.world_size = meta["processes"]
                    recorder.clock_offset = meta["clock"]
                    recorder.start()
                self._directory = meta["directory"]
                return "started", None, {}
            if op == "stop":
                if self._directory is None:
                    return "stopped", {"path": None}, {}
                recorder.stop()
                path = recorder.write(self._directory)
                recorder.clear()
                self._directory = None
                return "stopped", {"path": str(path)}, {}
        raise ParameterServerError(
            f"Unknown trace request on {recorder.task}. Received: {op!r}. The chief sends 'clock', 'start' or 'stop'; "
            "run every task of the job with the same stratagem."
        )


class JobTasks(Protocol):
    """What the trace reads of the job's tasks (`tasks.TaskPlan`)."""

    @property
    def task(self) -> str: ...
    @property
    def is_coordinator(self) -> bool: ...
    @property
    def workers(self) -> tuple[tuple[str, str], ...]: ...
    @property
    def parameter_servers(self) -> tuple[str, ...]: ...
    @property
    def security(self) -> Security: ...


class TraceSession:
    """The chief's side of a job's trace (see the module docstring); on other tasks it stays off. `ps_service`: the
    parameter servers' gRPC service, whose `Trace` method starts and stops them."""

    def __init__(self, plan: JobTasks, *, ps_service: str, rpc_timeout: float) -> None:
        self.recorder = recorder = Recorder(rank=0, task=plan.task)
        self._plan = plan
        self._ps_service = ps_service
        self._rpc_timeout = rpc_timeout
        self._num_workers = len(plan.workers)
        self._num_ps = len(plan.parameter_servers)
        self._lock = threading.Lock()
        self._started: dict[str, Client] = {}  # task -> the client it was started (and is stopped) through
        self._owned: list[Client] = []  # the servers' clients, made here (a worker's is its dispatch thread's)
        self._starting: set[str] = (
            set()
        )  # tasks whose start is under way (outside the lock: a slow task holds no other)
        self._placed = False
        self.directory: str | None = None
        rank, role, file = self._place(plan.task)
        recorder.rank, recorder.role, recorder.file_name, recorder.task = rank, role, file, plan.task
        recorder.world_size = self._num_workers + self._num_ps + (role == "chief")

    @property
    def on(self) -> bool:
        return self.recorder.on

    def now(self) -> int | None:
        """The trace's time now while it records (the start of a schedule or dispatch span), else None."""
        return self.recorder.now() if self.recorder.on else None

    def scheduled(self, closure: dict[str, Any], started: int | None) -> None:
        """`schedule` queued `closure` (`closure_args`), from `started`: a span of the calling thread."""
        if started is not None and self.recorder.on:
            name = f"schedule {closure['name']}"
            self.recorder.span("schedule", name, started, self.recorder.now(), args={"closure": closure["number"]})

    def dispatched(self, worker: str, closure: dict[str, Any], started: int | None) -> None:
        """A dispatch thread took `closure` at `started` and has its result from `worker` now."""
        if started is not None and self.recorder.on:
            self.recorder.span("dispatch", closure["name"], started, self.recorder.now(), track=f"dispatch {worker}",
                               args={"closure": closure["number"], "attempt": closure["attempt"],
                                     "flow": closure["flow"]})  # fmt: skip

    def _place(self, task: str) -> tuple[int, str, str]:
        """A task's rank, role and file in the trace."""
        kind, _, index = task.partition(":")
        if kind == "worker":
            return int(index), "worker", f"worker-{index}.json"
        if kind == "ps":
            return self._num_workers + int(index), "ps", f"ps-{index}.json"
        return self._num_workers + self._num_ps, "chief", "chief.json"

    def begin(self, directory: str | Path, *, clock: Clock | None = None) -> None:
        """Starts the chief's recorder; the other tasks follow (`placed`, `worker_ready`)."""
        if self.recorder.on:
            raise InputError(
                f"A trace is recording already (to {self.directory!r}). Received: strategy.trace({str(directory)!r}) "
                "inside it. End the first trace, or unset STRATAGEM_TRACE (stratagem launch --trace) to trace only "
                "this range."
            )
        self.recorder.clear()
        if clock is not None:
            self.recorder.clock = clock
        self.directory = str(directory)
        self.recorder.start()
        if self._placed:
            self._start_parameter_servers()

    @contextlib.contextmanager
    def trace(self, directory: str | Path, *, clock: Clock | None = None, mode: str = "spans") -> Iterator[Recorder]:
        """`ParameterServerStrategy.trace`: `begin`, the block, `end`; on the coordinator only, span by span."""
        coordinator = self._plan.is_coordinator
        if mode != "spans" or not coordinator:
            raise InputError(
                "A parameter-server job is traced from its coordinator, span by span (its workers have no steps to "
                f"fold). Received: trace(mode={mode!r}) on {self._plan.task}{'' if coordinator else ', not the coordinator'}"
                ". Call strategy.trace(DIR) on the coordinator, with mode='spans'."
            )
        self.begin(directory, clock=clock)
        try:
            yield self.recorder
        finally:
            self.end()

    def placed(self) -> None:
        """`distribute` has created the shards: the parameter servers answer from now on."""
        self._placed = True
        if self.recorder.on:
            self._start_parameter_servers()

    def worker_ready(self, client: Client) -> None:
        """Before a function is dispatched to `client`'s worker: starts its trace if it records none yet."""
        if not self.recorder.on or client.task in self._started or client.task == self._plan.task:
            return
        self._start(client)

    def _start_parameter_servers(self) -> None:
        for index, address in enumerate(self._plan.parameter_servers):
            task = f"ps:{index}"
            if task not in self._started:
                self._start(Client(address, self._ps_service, security=self._plan.security, task=task), owned=True)

    def _start(self, client: Client, *, owned: bool = False) -> None:
        """Starts `client`'s task (once); a task that does not answer in time is named in a warning and left out."""
        with self._lock:
            if client.task in self._started or client.task in self._starting or self.directory is None:
                return
            self._starting.add(client.task)
            directory = self.directory
        timeout = min(self._rpc_timeout, START_TIMEOUT)
        try:
            offset = measure(
                lambda: int(client.call("Trace", "clock", timeout=timeout, small_reply=True)[1]["ns"]),
                clock=self.recorder.clock,
            )
            rank, role, file = self._place(client.task)
            meta = {"rank": rank, "role": role, "file": file, "directory": directory,
                    "processes": self.recorder.world_size, "clock": offset.to_dict()}  # fmt: skip
            client.call("Trace", "start", meta, timeout=timeout, small_reply=True)
        except (ParameterServerError, CollectiveTimeoutError) as exc:
            logger.warning("%s records no trace (its file will be missing): %s", client.task, exc)
            if owned:
                client.close()
            return
        finally:
            with self._lock:
                self._starting.discard(client.task)
        with self._lock:
            self._started[client.task] = client
            if owned:
                self._owned.append(client)

    def end(self) -> list[Path]:
        """Stops every task started (each writes its file) and writes the chief's; returns the files written."""
        if not self.recorder.on or self.directory is None:
            return []
        written: list[Path] = []
        with self._lock:
            for task, client in self._started.items():
                try:
                    path = client.call("Trace", "stop", timeout=self._rpc_timeout, small_reply=True)[1]["path"]
                except (ParameterServerError, CollectiveTimeoutError) as exc:
                    logger.warning("%s did not write its trace file: %s", task, exc)
                    continue
                if path is not None:
                    written.append(Path(path))
            for client in self._owned:
                client.close()
            self._started, self._owned = {}, []
            self.recorder.stop()
            written.append(self.recorder.write(self.directory))
            self.recorder.clear()
            self.directory = None
        return written


def span(
    recorder: Recorder | None, category: str, name: str, *, track: str = FUNCTIONS, **args: Any
) -> contextlib.AbstractContextManager[None]:
    """The block as a span of `recorder` on `track` (a worker's functions by default), while it records."""
    return spanning(recorder, category, name, track=track, **args)


def traced_calls(
    recorder: Recorder | None,
    op: str,
    call: Callable[[int, list[Shard]], Any],
    tensors: Mapping[str, torch.Tensor | None],
    via: Callable[[int], str],
) -> Callable[[int, list[Shard]], Any]:
    """`call(ps, shards)`, a pull from or push to one server, recorded on that server's transport track while
    `recorder` records: op, bytes (of the shards of `tensors` it carries: the values pulled, the gradients pushed),
    and `via(ps)`, how they travel."""
    if recorder is None or not recorder.on:
        return call

    def traced(ps: int, shards: list[Shard]) -> Any:
        start = recorder.now()
        try:
            return call(ps, shards)
        finally:
            nbytes = sum(
                shard_of(t, s).numel() * t.element_size() for s in shards if (t := tensors.get(s.parameter)) is not None
            )
            where = "from" if op == "pull" else "to"
            recorder.span("rpc", f"{op} {where} ps:{ps}", start, recorder.now(), track=f"transport: ps:{ps}",
                          args={"op": op, "ps": f"ps:{ps}", "bytes": nbytes, "via": via(ps)})  # fmt: skip

    return traced


class Closure(Protocol):
    """What the trace reads of a scheduled function (the coordinator's `_Closure`)."""

    number: int
    name: str
    attempts: int


def closure_args(closure: Closure) -> dict[str, Any]:
    """What the trace files a scheduled function under, on the chief and on its worker (the flow joins the two)."""
    number, attempt = closure.number, closure.attempts
    return {"number": number, "name": closure.name, "attempt": attempt, "flow": f"closure {number}.{attempt}"}


def function_started(recorder: Recorder | None, closure: Any) -> int | None:
    """A scheduled function starts on this worker: its spans are filed under its closure number."""
    if recorder is None or not recorder.on or not isinstance(closure, dict):
        return None
    recorder.at_step(int(closure["number"]))
    return recorder.now()


def function_ended(recorder: Recorder | None, closure: Any, started: int | None) -> None:
    if started is None or recorder is None or not recorder.on:
        return
    recorder.span("function", str(closure["name"]), started, recorder.now(), track=FUNCTIONS,
                  args={"closure": closure["number"], "attempt": closure["attempt"], "flow": closure["flow"]})  # fmt: skip
