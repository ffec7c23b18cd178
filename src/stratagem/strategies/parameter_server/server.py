"""The parameter-server task: holds shards of the model's parameters and applies the user's optimizer.

The chief creates the shards (``Create``: initial values and the optimizer's spec, its class,
hyper-parameters and options, from which ``optimizers`` builds it again); workers read them
(``Pull``, many shards in one call) and send gradients (``Push``). A push applies the same torch optimizer the user built, with its
state (momentum buffers, Adam moments, step counts), to the shards it names, under a lock, so each
update is atomic and updates from different workers apply one after another (asynchronous
training: no worker waits for another). The optimizers torch ships update each element from its
own gradient and state, so updating a shard equals updating those rows of the whole tensor; an
optimizer that looks across a whole tensor (LBFGS, factored second moments) would need whole
tensors, which is what placement without a partitioner gives.

A push is applied segment by segment as its gradient arrives (``ShardStore.step_ready``), under the
lock; a push cut off mid-way leaves the segments it had fully sent updated (as a tf.distribute step
that dies after updating some variables). A pull starts under the same lock and is sent from the
live values, piece by piece; an update that comes while a pull is still being sent first copies
the values for it (copy on write), so a pull never sees half of a push and costs no copy of the
model when none overlaps it.

``Save`` returns every shard and its optimizer state; ``Load`` puts them back (checkpoints).

A worker on the same host pulls and pushes through a shared-memory file instead (``shared``):
``Attach`` maps it, ``PullShared`` copies the values into it under the lock, ``PushShared``
applies the gradients it holds, ``Detach`` lets it go.

    >>> ps = ParameterServer(security=Security(token="t"), task="ps:0")   # doctest: +SKIP
    >>> ps.stopped(timeout=60.0)                                           # True once the chief ended the job
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from stratagem.errors import (
    ParameterServerError,
    WireFormatError,
)
from stratagem.shm import parameter_server as shared
from stratagem.strategies.parameter_server import wire
from stratagem.strategies.parameter_server.optimizers import build_optimizer, hypers_of, resolve_optimizer_class
from stratagem.strategies.parameter_server.store import (
    BUCKET_PREFIX,
    ShardStore,
    bucket_name,
)
from stratagem.strategies.parameter_server.tracing import UPDATES, TaskTrace, span
from stratagem.strategies.parameter_server.transport import (
    LARGE,
    SMALL,
    SMALL_HEADER_BYTES,
    Limit,
    Reply,
    Security,
    Server,
    Streaming,
)

logger = logging.getLogger(__name__)

SERVICE = "stratagem.ParameterServer"
HEADER_BYTES_PER_SHARD = 512
"""Room in a header for one shard's entry (its name, dtype, shape, offset) and its group or scalars."""
MAX_STATE_TENSORS = 8
"""A checkpoint's shard: its values and at most 7 state tensors of its size (Adam with amsgrad keeps 3)."""
STATE_SEPARATOR = "#"


class _Read:
    """A pull being sent. It reads the store's live values, piece by piece, until an update is about to
    change them: the update first copies them for it (``ParameterServer._keep_reads``), and the pull
    goes on from that copy. So a pull costs no copy of the model unless an update overlaps it."""

    __slots__ = ("__weakref__", "copied", "meta", "store", "values")

    def __init__(self, store: ShardStore, meta: dict[str, Any]) -> None:
        self.store = store
        self.meta = meta
        self.values = [bucket.values for bucket in store.buckets]
        self.copied = False

    def parts(self) -> list[Any]:
        """The reply's parts (``wire.segments``) over the values it reads now."""
        return wire.segments("values", self.meta, {bucket_name(i): t for i, t in enumerate(self.values)})


class ParameterServer:
    """One parameter-server task: a gRPC service over the shards it holds (a ``ShardStore``)."""

    def __init__(self, *, security: Security, address: str = "127.0.0.1:0", task: str = "ps:0") -> None:
        self.task = task
        self._lock = threading.Lock()
        self._reads_lock = threading.Lock()  # held while a piece is cut from live values, or they are copied
        # Pulls being sent (a pull whose reply gRPC drops unsent is forgotten with it).
        self._reads: weakref.WeakSet[_Read] = weakref.WeakSet()
        self._store = ShardStore({}, {}, None, [])
        self._segments = shared.Segments(task)
        self._num_updates = 0
        self._shutdown = threading.Event()
        self.trace = TaskTrace(task)
        """This server's trace: each push applied, started and stopped by the chief (`tracing.py`)."""
        self._server = Server(
            SERVICE,
            {
                "Create": self._create,
                "Pull": self._pull,
                "Push": Streaming(self._push),
                "Save": self._save,
                "Load": self._load,
                "Shutdown": self._stop,
                "Ping": self._ping,
                "Attach": self._attach,
                "Detach": self._detach,
                "PullShared": self._pull_shared,
                "PushShared": self._push_shared,
                "Trace": self.trace.handle,
            },
            security=security,
            address=address,
            default_limit=SMALL,
            limits={
                # What each request can carry; every other method takes a few names and numbers, no tensors.
                "Create": LARGE,
                "Load": Limit(self._state_header_bytes, self._state_payload_bytes),
                "PushShared": Limit(self._header_bytes),  # lists the buckets it carries
            },
        )
        self.address = self._server.address

    # ---- handlers ------------------------------------------------------------------------------
    def _create(self, op: str, meta: Any, tensors: dict[str, torch.Tensor]) -> Reply:
        groups_of = meta.get("groups", {}) if isinstance(meta, dict) else {}
        spec = meta.get("optimizer") if isinstance(meta, dict) else None
        if set(groups_of) != set(tensors) or not all(isinstance(g, int) and g >= 0 for g in groups_of.values()):
            raise WireFormatError(
                f"Create needs a group index for every shard. Received: shards {sorted(tensors)[:5]}, "
                f"groups {dict(list(groups_of.items())[:5])}. Send both."
            )
        cls, hypers = None, []
        if spec is not None and tensors:
            cls = resolve_optimizer_class(spec["module"], spec["qualname"])
            hypers = hypers_of(spec)
            if max(groups_of.values()) >= len(hypers):
                raise WireFormatError(
                    f"A shard names a parameter group the optimizer lacks. Received: group "
                    f"{max(groups_of.values())} of {len(hypers)}. Send every group's hyper-parameters."
                )
        store = ShardStore(tensors, groups_of, cls, hypers, build=functools.partial(build_optimizer, spec=spec or {}))
        with self._lock:
            self._store, self._num_updates = store, 0
            self._segments.clear()  # laid out for the old shards: workers attach again
        logger.info(
            "%s holds %d shards in %d buckets (%d elements), optimizer %s over %s",
            self.task,
            len(store.shards),
            len(store.buckets),
            sum(p.numel() for p in store.shards.values()),
            cls.__name__ if cls else None,
            "buckets" if store.flat else "shards",
        )
        return "created", {"shards": len(store.shards), "layout": store.fingerprint}, {}

    # ---- what a request may carry ----------------------------------------------------------------
    def _header_bytes(self) -> int:
        """A header naming every shard this server holds: its entry and a few scalars of state each."""
        return SMALL_HEADER_BYTES + HEADER_BYTES_PER_SHARD * (len(self._store.shards) + len(self._store.buckets))

    def _state_header_bytes(self) -> int:
        return self._header_bytes() * MAX_STATE_TENSORS

    def _state_payload_bytes(self) -> int:
        """A ``Load``: every shard's values and at most ``MAX_STATE_TENSORS - 1`` state tensors of its size."""
        held = sum(shard.nbytes for shard in self._store.shards.values())
        # Some room whatever is held, so a small checkpoint for other shards hears which shards are wrong.
        return MAX_STATE_TENSORS * held + wire.ALIGN * MAX_STATE_TENSORS * len(self._store.shards) + (1 << 20)

    def _check_layout(self, meta: Any) -> None:
        given = meta.get("layout") if isinstance(meta, dict) else None
        if given != self._store.fingerprint:
            raise WireFormatError(
                f"{self.task} holds a different set of shards than the caller expects. Received: layout {given!r}, "
                f"this server's is {self._store.fingerprint!r} ({len(self._store.shards)} shards). Run the same "
                "model on every task, and distribute it on the chief before workers pull (a restarted chief "
                "creates the shards again)."
            )

    def _pull(self, op: str, meta: Any, tensors: dict[str, torch.Tensor]) -> Reply:
        with self._lock:  # no update is under way while a pull starts
            self._check_layout(meta)
            read = _Read(self._store, {"version": self._num_updates})
            with self._reads_lock:
                self._reads.add(read)
        return self._send(read)

    def _send(self, read: _Read) -> Iterator[bytes]:
        """A pull's pieces, each cut as gRPC asks for it (into memory freed by the piece before), from the
        values as they were when the pull came: the live ones, or the copy an update made first."""
        try:
            parts, copied = read.parts(), False
            pieces = wire.piece_bounds([memoryview(part).nbytes for part in parts])
            for index, bounds in enumerate(pieces):
                with self._reads_lock:
                    if read.copied and not copied:
                        parts, copied = read.parts(), True
                    piece = wire.join_piece(parts, bounds)
                    if index == len(pieces) - 1:  # every byte is cut: an update need not wait for the send
                        self._reads.discard(read)
                yield piece
        finally:
            with self._reads_lock:
                self._reads.discard(read)
            if read.copied:
                read.store.release(read.values)

    # ---- shared memory (a worker on this host) -------------------------------------------------
    def _attach(self, op: str, meta: Any, tensors: dict[str, torch.Tensor]) -> Reply:
        with self._lock:
            store = self._store
            buckets = [(b.values.dtype, b.values.numel()) for b in store.buckets]
            reply, info = self._segments.attach(meta, store.fingerprint, buckets)
            if reply == "attached" and info["counters"]:
                attached = self._segments.get(info["segment"], store.fingerprint)
                assert attached is not None  # attached just now, under the same lock and fingerprint
                threading.Thread(
                    target=self._serve_file, args=(attached,), daemon=True, name=f"{self.task}-shared-{attached.task}"
                ).start()
            return reply, info, {}

    def _serve_file(self, attached: shared.Attached) -> None:
        """Serves the requests a worker makes through its file's counters, one at a time, until the file is let
        go (the worker detached or exited, the shards were created anew, or this server stops)."""
        control = attached.areas.control
        if control is None:
            return  # let go (its areas closed) before this thread started: nothing left to serve
        words = control.words

        def check() -> None:
            if attached.let_go:
                raise shared.Stop
            if attached.worker_gone():
                with self._lock:
                    self._segments.forget_gone()  # this one among them
                raise shared.Stop

        handled = 0
        while True:
            try:
                control.wait(shared.REQUEST, handled + 1, spin=0.0, check=check)
            except shared.Stop:
                return
            handled = int(words[shared.REQUEST])
            try:
                with self._lock:
                    if attached.let_go:
                        control.answer(handled, shared.UNATTACHED)
                        continue
                    op = int(words[shared.OP])
                    if op == shared.PULL:
                        version = self._copy_values(attached)
                    elif op == shared.PUSH:
                        count = int(words[shared.COUNT])
                        indices = control.listed[: min(max(count, 0), shared.MAX_LISTED)].tolist()
                        version = self._apply_gradients(attached, indices)
                    else:
                        raise WireFormatError(
                            f"Unknown request in a shared file. Received: operation {op}. "
                            f"Use {shared.PULL} (pull) or {shared.PUSH} (push)."
                        )
                    control.answer(handled, shared.OK, version)
            except Exception as exc:  # the worker gets the error; the server goes on serving
                logger.exception("%s: a request of %s through shared memory failed", self.task, attached.task)
                control.answer(handled, shared.FAILED, error=f"{type(exc).__name__}: {exc}")

    def _detach(self, op: str, meta: Any, tensors: dict[str, torch.Tensor]) -> Reply:
        with self._lock:
            return (
                "detached",
                {"known": self._segments.detach(meta.get("segment") if isinstance(meta, dict) else None)},
                {},
            )

    def _attached(self, meta: Any) -> shared.Attached | None:
        """The file a shared pull or push names (under ``_lock``), or None when this server does not know it."""
        self._check_layout(meta)
        return self._segments.get(meta.get("segment"), self._store.fingerprint)

    def _pull_shared(self, op: str, meta: Any, tensors: dict[str, torch.Tensor]) -> Reply:
        with self._lock:
            attached = self._attached(meta)
            if attached is None:
                return "unattached", {}, {}
            return "values", {"version": self._copy_values(attached)}, {}

    def _push_shared(self, op: str, meta: Any, tensors: dict[str, torch.Tensor]) -> Reply:
        with self._lock:
            attached = self._attached(meta)
            if attached is None:
                return "unattached", {}, {}
            return "applied", {"version": self._apply_gradients(attached, meta.get("buckets"))}, {}

    def _copy_values(self, attached: shared.Attached) -> int:
        """A pull through a worker's file (under ``_lock``): every bucket's values into its values area."""
        for area, bucket in zip(attached.areas.pull, self._store.buckets):
            area.copy_(bucket.values)
        return self._num_updates

    def _apply_gradients(self, attached: shared.Attached, indices: Any) -> int:
        """A push through a worker's file (under ``_lock``): the optimizer over the gradients of the buckets named."""
        store = self._optimizing_store()
        if not (
            isinstance(indices, list)
            and indices
            and len(set(indices)) == len(indices)
            and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(store.buckets) for i in indices)
        ):
            raise WireFormatError(
                f"A shared push names buckets this server does not hold. Received: "
                f"buckets={indices!r:.100}, {len(store.buckets)} buckets here. Name each "
                "bucket the push carries once."
            )
        with span(
            self.trace.recorder, "update", "apply push", track=UPDATES, via="shared memory", worker=attached.task
        ):
            self._keep_reads()
            store.apply_buckets({index: attached.areas.push[index] for index in indices})
        self._num_updates += 1
        return self._num_updates

    def _optimizing_store(self) -> ShardStore:
        """The store a push updates (under ``_lock``); refuses a push that comes before ``Create``."""
        if self._store.optimizer is None:
            raise ParameterServerError(
                f"{self.task} has no optimizer, so it cannot apply gradients. Received: a "
                "push before Create. Call distribute(model, optimizer) on the chief first."
            )
        return self._store

    def _keep_reads(self) -> None:
        """Before values change (under ``_lock``): pulls still reading them get their own copy first."""
        with self._reads_lock:
            for read in list(self._reads):
                if not read.copied and read.store is self._store:
                    read.values, read.copied = read.store.snapshot(), True

    def _push(self, pieces: Iterator[bytes]) -> Reply:
        # The gradient bytes stream straight into the buckets' gradient buffers (one copy, into memory
        # already paged in); the lock is held from the first byte, so pushes apply one after another.
        with self._lock, span(self.trace.recorder, "update", "receive and apply push", track=UPDATES, via="gRPC"):
            store = self._optimizing_store()
            self._keep_reads()
            # The progress callback checks the layout as soon as the header is in, before any update.
            _, _, names = wire.decode_into(
                pieces,
                store.destinations(),
                exact=False,
                progress=self._updates_as_received(store),
                max_header_bytes=self._header_bytes(),
            )
            store.apply(names)
            self._num_updates += 1
            return "applied", {"version": self._num_updates}, {}

    def _updates_as_received(self, store: ShardStore) -> Callable[[dict[str, Any], int], None]:
        """A ``progress`` for ``wire.decode_into``: once the header is checked, each segment of a whole-bucket
        push is updated as soon as its gradient is in, while the rest of the push is still arriving."""
        plan: list[tuple[int, int, int]] | None = None  # (bucket, payload offset, bytes per element)

        def progress(header: dict[str, Any], received: int) -> None:
            nonlocal plan
            if plan is None:
                self._check_layout(header["meta"])
                entries = header["tensors"]
                # Only when the push names whole buckets: one naming shards may switch the store to shards.
                whole = all(entry[0].startswith(BUCKET_PREFIX) for entry in entries)
                indices = [int(entry[0][len(BUCKET_PREFIX) :]) for entry in entries] if whole else []
                plan = [
                    (index, entry[3], store.buckets[index].values.element_size())
                    for index, entry in zip(indices, entries)
                ]
            for index, offset, itemsize in plan:
                if received > offset:
                    store.step_ready(index, (received - offset) // itemsize)

        return progress

    def _known(self, names: list[str]) -> None:
        unknown = [n for n in names if n not in self._store.shards]
        if unknown:
            raise WireFormatError(
                f"{self.task} holds no shard named {unknown[:3]}. Received: {len(names)} names. "
                f"Send only shards placed on {self.task} (it holds {len(self._store.shards)}); "
                "was the model distributed by this job's chief?"
            )

    def _save(self, op: str, meta: Any, tensors: dict[str, torch.Tensor]) -> Reply:
        with self._lock:
            out = {name: p.detach().clone() for name, p in self._store.shards.items()}
            scalars: dict[str, dict[str, Any]] = {}
            for name in self._store.shards:
                for key, value in self._store.shard_state(name).items():
                    if isinstance(value, torch.Tensor):
                        out[f"{name}{STATE_SEPARATOR}{key}"] = value.detach().clone()
                    else:
                        scalars.setdefault(name, {})[key] = value
            return "saved", {"scalars": scalars, "version": self._num_updates}, out

    def _load(self, op: str, meta: Any, tensors: dict[str, torch.Tensor]) -> Reply:
        with self._lock:
            values = {n: t for n, t in tensors.items() if STATE_SEPARATOR not in n}
            self._known(list(values))
            states: dict[str, dict[str, Any]] = {}
            for key, value in tensors.items():
                if STATE_SEPARATOR in key:
                    name, state_key = key.split(STATE_SEPARATOR, 1)
                    states.setdefault(name, {})[state_key] = value.clone()
            scalars = meta.get("scalars", {}) if isinstance(meta, dict) else {}
            for name, state in scalars.items():
                states.setdefault(name, {}).update(state)
            self._known(list(states))
            self._keep_reads()
            with torch.no_grad():
                for name, value in values.items():
                    self._store.shards[name].copy_(value)
            self._store.load_state(states)
        return "loaded", {"shards": len(values)}, {}

    def _stop(self, op: str, meta: Any, tensors: dict[str, torch.Tensor]) -> Reply:
        logger.info("%s: shutdown requested by the chief", self.task)
        self._shutdown.set()
        return "stopping", None, {}

    def _ping(self, op: str, meta: Any, tensors: dict[str, torch.Tensor]) -> Reply:
        return "pong", {"task": self.task, "shards": len(self._store.shards), "version": self._num_updates}, {}

    # ---- life cycle ----------------------------------------------------------------------------
    def stopped(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds for the chief's Shutdown; True once it came."""
        return self._shutdown.wait(timeout)

    def stop(self, grace: float = 0.0) -> None:
        """Stops serving; calls in flight get ``grace`` seconds (0: at once, as if the process died)."""
        self._shutdown.set()
        self._server.stop(grace=grace)
        with self._lock:
            self._segments.clear()  # workers waiting on a file hear at once, and go to gRPC, which says why
