"""Pulls and pushes through shared memory when a worker and a parameter server run on one host.

Over gRPC, a pull's values are copied four times on their way (the server's tensors into the
message, gRPC's copy of it, the socket, gRPC's ``bytes`` on the worker, then into the worker's
parameters), and a push's gradients the same the other way. On one host none of that is needed:
the worker maps one file in ``/dev/shm`` with an area for each direction, laid out as the
server's buckets (each at a multiple of 64 bytes)::

    head: magic and the worker's nonce; the control block (the worker's line: request number,
        operation, number of buckets listed; the server's lines: answer number, outcome, version,
        and "let go"); the buckets a push carries; the text of a failure
    pull area: bucket 0's values, bucket 1's values, ...
    push area: bucket 0's gradient, bucket 1's gradient, ...

- A pull: the server copies its buckets into the pull area under its lock (so it never sees half
  of a push) and answers. The worker's parameters live in the pull area (``arrange``), so that is
  the only copy.
- A push: the worker copies its gradients into the push area and asks; the server runs the
  optimizer on the gradients where they lie. One copy in all.

How the worker asks. On Linux x86-64 (ordered stores, futex(2)) through the control block: the
worker writes the operation, then the request number, and wakes the server's thread for this file,
which handles it under the server's lock, writes the outcome, then the answer number, and wakes the
worker (``counters``; a round trip of tens of microseconds, where a gRPC call takes about a
millisecond). Every wait is bounded: the worker polls for 100 µs, then sleeps, and every 50 ms
checks that the server's process still runs (by pid and start time: a lost server is named at
once, as gRPC would name it) and the clock (the RPC timeout); the server's thread checks that the
worker's process still runs and lets the file go when it is gone. Elsewhere each request is a small gRPC call (``PullShared``,
``PushShared``). Either way the worker writes an area only before it asks and reads it only after
the answer, one request at a time per file. A push that leaves out part of a bucket (a parameter
without a gradient) goes over gRPC.

Who may use a file: only the worker that made it (a file of this user, mode 0600) and a server it
attached it to through an authenticated call (``Attach``, with the cluster token like every call).
The server maps it only when the worker says it runs on the same host (host name and boot id), the
name is one of ours in ``/dev/shm``, the file is a regular file of the server's user of the size
its buckets need, and it starts with the head the worker sent. The server unlinks the file as soon
as it has mapped it (and the worker once the server has answered, if it is still there), so nobody
can open it afterwards; a file of a worker killed before the server mapped it is removed by the next
file made on this host (``files.remove_stale``). The server lets a file go when the
worker detaches (``close``), when the process that attached it is gone, when the chief creates the
shards anew, or when the server stops; a worker waiting on it sees "let go" at once, and attaches
again (or, if the server is gone, hears so from gRPC).

``STRATAGEM_SHARED_MEMORY=0`` turns this path off on either side (``eligibility``): a worker then
sends everything over gRPC, and a server refuses the files offered to it.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy
import torch

from stratagem.errors import (
    CollectiveTimeoutError,
    ParameterServerError,
    WireFormatError,
)
from stratagem.shm import eligibility, files
from stratagem.shm.counters import Counters, Stop
from stratagem.shm.eligibility import TURNED_OFF as TURNED_OFF  # what a user of this path shows

logger = logging.getLogger(__name__)

MAGIC = b"SGPSSHM1"
ALIGN = 64
# The control block after the magic and nonce: counters and fields of 8 bytes, one cache line per writer.
REQUEST, OP, COUNT = 8, 9, 10  # the worker's line: request number, operation, buckets listed
_REPLY, _STATUS, _VERSION, _ERROR_LEN = 16, 17, 18, 19  # the server's line: answer number, outcome, version
_LET_GO = 24  # the server's second line: non-zero once it no longer serves this file
_LIST = 256  # the buckets a push carries (uint32 each), written by the worker
_ERROR = _LIST + 4096  # the text of a failure, written by the server
HEAD = _ERROR + 4096
_ERROR_BYTES = 4096
MAX_LISTED = 1024
PULL, PUSH = 1, 2
OK, UNATTACHED, FAILED = 0, 1, 2
SPIN_SECONDS = 100e-6
"""How long a worker polls for the server's answer before it sleeps (an answer takes 20-200 µs)."""
CHECK_SECONDS = 0.05
"""How often a sleeping side wakes to check the other is alive, the clock, and whether to stop."""
PREFIX = "stratagem-ps-"
_NAME = re.compile(r"stratagem-ps-[A-Za-z0-9_]{1,64}\Z")

Buckets = Sequence[tuple[torch.dtype, int]]
"""Each bucket's dtype and element count, in the server's order."""


def eligible(directory: str = files.DIRECTORY) -> str | None:
    """None when this process can share memory with a parameter server, else why not (requests go through the
    file's counters only where ``eligibility.ordered_stores`` allows; elsewhere they are small gRPC calls)."""
    return eligibility.why_not("shared memory between a worker and a parameter server", directory, ordered=False)


def area_offsets(buckets: Buckets) -> tuple[list[int], int]:
    """Where each bucket starts in an area, and the area's size in bytes."""
    offsets, size = [], 0
    for dtype, numel in buckets:
        offsets.append(size)
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        size += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return offsets, size


def file_size(buckets: Buckets) -> int:
    return HEAD + 2 * area_offsets(buckets)[1]


def describe_bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{-(-n // 1024)} KiB"


def head(nonce: bytes) -> bytes:
    return MAGIC + nonce


class Areas:
    """A mapped file's two areas as one tensor per bucket: ``pull[i]`` and ``push[i]``."""

    def __init__(self, mapping: mmap.mmap, buckets: Buckets) -> None:
        self.mapping = mapping
        offsets, area = area_offsets(buckets)
        whole = files.as_tensor(mapping)  # views keep the mapping alive: a worker's parameters may be some

        def view(offset: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
            nbytes = numel * torch.empty(0, dtype=dtype).element_size()
            return whole[offset : offset + nbytes].view(dtype)

        self.pull = [view(HEAD + o, d, n) for (d, n), o in zip(buckets, offsets)]
        self.push = [view(HEAD + area + o, d, n) for (d, n), o in zip(buckets, offsets)]
        self.nbytes = len(mapping)
        self.control: Control | None = Control(mapping)

    def close(self) -> None:
        self.pull, self.push, self.control = [], [], None
        try:
            self.mapping.close()
        except BufferError:  # a view is still alive (a worker's parameters): the mapping goes with the last one
            logger.debug("a view of a shared area is still alive; it is unmapped when the last view is freed")


class Control:
    """The control block of a file: counters and fields both sides read and write (see the module's docstring)."""

    def __init__(self, mapping: mmap.mmap) -> None:
        self.counters = Counters(mapping, count=HEAD // 8)
        self.words = self.counters.words
        self.listed = numpy.frombuffer(mapping, dtype=numpy.uint32, count=MAX_LISTED, offset=_LIST)
        self.error = numpy.frombuffer(mapping, dtype=numpy.uint8, count=_ERROR_BYTES, offset=_ERROR)

    def publish(self, index: int, value: int) -> None:
        """Stores ``value`` in counter ``index`` (after everything written before it) and wakes its sleepers."""
        self.counters.publish(index, value)

    def wait(self, index: int, target: int, *, spin: float, check: Callable[[], None]) -> None:
        """Returns once counter ``index`` reaches ``target``: polls for ``spin`` seconds, then sleeps on it, and
        calls ``check`` every ``CHECK_SECONDS`` (it raises to give up: an error, or ``Stop``)."""
        self.counters.wait(index, target, spin=spin, check_every=CHECK_SECONDS, check=check)

    def let_go(self) -> None:
        """The server's last word: it serves this file no more (a worker waiting on it hears at once)."""
        self.words[_LET_GO] = 1
        for index in (_REPLY, REQUEST):
            self.counters.wake(index)

    def answer(self, seq: int, status: int, version: int = 0, error: str = "") -> None:
        """The server's reply to request ``seq``."""
        text = error.encode()[:_ERROR_BYTES]
        self.error[: len(text)] = numpy.frombuffer(text, dtype=numpy.uint8)
        self.words[_ERROR_LEN] = len(text)
        self.words[_STATUS] = status
        self.words[_VERSION] = version
        self.publish(_REPLY, seq)


# ---- the worker's side ------------------------------------------------------------------------
@dataclass
class Link:
    """A worker's file attached to one parameter server: its areas and the server's name for it."""

    areas: Areas
    segment: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held for a call and its copies, so two threads of one worker never use an area at once."""
    push_views: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Per bucket, views of the push area shaped as the gradients (their shapes do not change)."""
    server: tuple[int, str | None] | None = None
    """The server's pid and start time when requests go through the file's counters (else None: gRPC calls)."""
    seq: int = 0
    residents: list[torch.Tensor] = field(default_factory=list)
    """A worker's parameters that live in the values area (``ShardedVariables.arrange``)."""

    def __post_init__(self) -> None:
        # Whether the server's process is visible from here (same pid namespace), known while it surely runs.
        self.watched = (
            self.server is not None
            and self.server[1] is not None
            and files.process_start(self.server[0]) == self.server[1]
        )


def request(link: Link, op: int, buckets: Sequence[int], *, timeout: float, server: str, what: str) -> bool:
    """One pull or push through the file's counters: True once the server has done it, False when it no
    longer serves this file (attach again). Raises when it fails, exits, or does not answer in time."""
    control = link.areas.control
    # The caller holds the link (open: its areas close with it) and asks the counters only of a server that serves them.
    assert control is not None and link.server is not None, "a request through a closed link or without a server"
    words = control.words
    if op == PUSH:
        control.listed[: len(buckets)] = buckets
        words[COUNT] = len(buckets)
    words[OP] = op
    link.seq += 1
    control.publish(REQUEST, link.seq)
    start = time.monotonic()
    pid, started = link.server

    def check() -> None:
        if words[_LET_GO]:
            raise Stop
        if link.watched and files.process_start(pid) != started:
            error = ParameterServerError(
                f"{server} (pid {pid}) exited during a {what} through shared memory. Received: no answer, and no such "
                f"process. Restart the job; it resumes from the last checkpoint (strategy.save)."
            )
            import grpc  # loaded already: this worker reached the server over gRPC first

            # UNAVAILABLE is how a lost server is told apart from other failures (transport.task_lost).
            error.code, error.task = grpc.StatusCode.UNAVAILABLE, server  # type: ignore[attr-defined]
            raise error
        if time.monotonic() - start > timeout:
            raise CollectiveTimeoutError(
                f"{server} did not answer a {what} through shared memory within {timeout:g} s. Received: no answer. "
                f"Check that {server} is alive and not overloaded, or raise rpc_timeout."
            )

    try:
        control.wait(_REPLY, link.seq, spin=SPIN_SECONDS, check=check)
    except Stop:
        return False
    status = int(words[_STATUS])
    if status == FAILED:
        text = bytes(control.error[: int(words[_ERROR_LEN])]).decode(errors="replace").rstrip(".")
        error = ParameterServerError(
            f"{server} failed a {what} through shared memory. Received: {text}. See the log of {server} for the cause."
        )
        error.task = server  # type: ignore[attr-defined]
        raise error
    return status == OK


def make_file(buckets: Buckets, directory: str = files.DIRECTORY) -> tuple[str, bytes, mmap.mmap] | str:
    """A new file for ``buckets``, mapped: ``(path, nonce, mapping)``, or why there is none."""
    why = eligible(directory)
    if why is not None:
        return why
    nonce = secrets.token_bytes(16)
    size = file_size(buckets)
    path, why = files.create(directory, size, head(nonce), prefix=PREFIX)
    if path is None:
        return why or "cannot create the file"
    mapping, why = files.open_mapped(path, size, head(nonce), maker="this worker")
    if mapping is None:
        os.unlink(path)
        return why or "cannot map the file"
    return path, nonce, mapping


# ---- the server's side ------------------------------------------------------------------------
@dataclass
class Attached:
    """A worker's file as a parameter server holds it."""

    areas: Areas
    fingerprint: str
    task: str
    process: tuple[int, str | None]
    watched: bool
    """Whether the worker's process was visible from here when it attached (same pid namespace)."""
    let_go: bool = False
    """Set (under the server's lock) once the server no longer serves this file."""

    def worker_gone(self) -> bool:
        pid, started = self.process
        return self.watched and files.process_start(pid) != started


class Segments:
    """The files workers attached to one parameter server. Not thread-safe: the server uses it under its lock."""

    def __init__(self, task: str, directory: str = files.DIRECTORY) -> None:
        self.task = task
        self.directory = directory
        self.host = files.host_identity()
        self._attached: dict[str, Attached] = {}

    def __len__(self) -> int:
        return len(self._attached)

    def attach(self, meta: Any, fingerprint: str, buckets: Buckets) -> tuple[str, dict[str, Any]]:
        """Maps the file a worker offers (``meta``: name, nonce, host, task, pid, start); returns the reply
        ``("attached", {"segment": id})`` or ``("refused", {"why": ..., "same_host": bool})``."""
        name, nonce, host, task, process = _offer(meta)
        self.forget_gone()
        off = eligibility.turned_off()
        if off is not None:  # this server's own switch: nothing for the worker to fix, so no warning there
            return "refused", {"why": f"{self.task}: {off}", "same_host": False}
        if host != self.host:
            return "refused", {"why": f"{task} runs on another host than {self.task}", "same_host": False}
        if meta.get("layout") != fingerprint:
            return "refused", {
                "why": f"{task} expects other shards than {self.task} holds",
                "same_host": True,
                "retry": True,
            }
        path = os.path.join(self.directory, name)
        mapping, why = files.open_mapped(path, file_size(buckets), head(nonce), maker=task)
        if mapping is None:
            return "refused", {"why": f"{self.task}: {why}", "same_host": True}
        files.unlink(path)  # both hold it now; so it is gone even if the worker dies before it hears back
        segment = secrets.token_hex(8)
        watched = process[1] is not None and files.process_start(process[0]) == process[1]
        self._attached[segment] = Attached(Areas(mapping, buckets), fingerprint, task, process, watched)
        logger.info(
            "%s: %s attached %s of shared memory (%d attached)",
            self.task,
            task,
            describe_bytes(len(mapping)),
            len(self._attached),
        )
        counters = meta.get("counters") is True and eligibility.ordered_stores() is None
        pid = os.getpid()
        return "attached", {"segment": segment, "counters": counters, "pid": pid, "start": files.process_start(pid)}

    def get(self, segment: Any, fingerprint: str) -> Attached | None:
        """The file ``segment`` names, or None when it is unknown here or was made for other shards."""
        attached = self._attached.get(segment) if isinstance(segment, str) else None
        if attached is not None and attached.fingerprint != fingerprint:
            self.detach(segment)
            return None
        return attached

    def detach(self, segment: Any) -> bool:
        attached = self._attached.pop(segment, None) if isinstance(segment, str) else None
        if attached is not None:
            attached.let_go = True
            if attached.areas.control is not None:
                attached.areas.control.let_go()
            attached.areas.close()
        return attached is not None

    def clear(self) -> None:
        for segment in list(self._attached):
            self.detach(segment)

    def forget_gone(self) -> None:
        """Lets go of files whose worker process has exited (a killed worker attaches a new one when restarted)."""
        for segment, attached in list(self._attached.items()):
            if attached.worker_gone():
                logger.info(
                    "%s: %s (pid %d) is gone; its shared memory is let go",
                    self.task,
                    attached.task,
                    attached.process[0],
                )
                self.detach(segment)


def _offer(meta: Any) -> tuple[str, bytes, str, str, tuple[int, str | None]]:
    """The fields of an ``Attach`` request, checked."""
    if not isinstance(meta, dict):
        raise WireFormatError(
            f"Attach needs a JSON object. Received: {type(meta).__name__}. Send "
            "{name, nonce, host, task, pid, start, layout}."
        )
    name, nonce, host, task = (meta.get(key) for key in ("name", "nonce", "host", "task"))
    pid, start = meta.get("pid"), meta.get("start")
    if not (isinstance(name, str) and _NAME.match(name)):
        raise WireFormatError(
            f"Attach names a file that is not one of stratagem's in /dev/shm. Received: "
            f"name={name!r:.80}. Offer a file made by stratagem.shm.parameter_server.make_file."
        )
    if not (isinstance(nonce, str) and re.fullmatch(r"[0-9a-f]{32}", nonce)):
        raise WireFormatError(
            f"Attach needs a nonce of 32 hex digits. Received: nonce={nonce!r:.80}. "
            "Offer a file made by stratagem.shm.parameter_server.make_file."
        )
    if not (
        isinstance(host, str)
        and isinstance(task, str)
        and isinstance(pid, int)
        and not isinstance(pid, bool)
        and (start is None or isinstance(start, str))
    ):
        raise WireFormatError(
            f"Attach needs host, task (strings) and pid (an integer). Received: host={host!r:.80}, "
            f"task={task!r:.80}, pid={pid!r:.20}, start={start!r:.20}. Send all of them."
        )
    return name, bytes.fromhex(nonce), host, task, (pid, start)


def offer(path: str, nonce: bytes, task: str, fingerprint: str) -> dict[str, Any]:
    """The ``Attach`` request's metadata for a file made by ``make_file``."""
    pid = os.getpid()
    return {
        "name": os.path.basename(path),
        "nonce": nonce.hex(),
        "host": files.host_identity(),
        "task": task,
        "pid": pid,
        "start": files.process_start(pid),
        "layout": fingerprint,
        "counters": eligibility.ordered_stores() is None,
    }


def copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copies each source into its target: one call when all are CPU tensors, one each otherwise (a GPU model)."""
    with torch.no_grad():
        if all(t.is_cpu for t in targets) and all(t.is_cpu for t in sources):  # is_cpu: no device object per tensor
            if targets:
                torch._foreach_copy_(targets, sources)
            return
        for target, source in zip(targets, sources):
            target.copy_(source)
