"""The client side of the parameter servers: where each shard lives, pull, push, checkpoints.

``ShardedVariables`` knows the placement (``partitioners.place``) and talks to every parameter
server: a pull asks each server once for all the shards it holds (one call per server, in
parallel), a push sends each server the gradient rows of its shards in one call, bucket by bucket
(``layout``). Errors name the parameter server that failed (``ps:1 at 127.0.0.1:4242 failed Pull ...``).

With a parameter server on the same host, pulls and pushes go through a shared-memory file instead
of gRPC messages (``shared``): attached at the first pull or push, after one ``Attach`` call.
``shared_memory=None`` (the default) uses it where it can, ``False`` never, ``True`` makes a server
that cannot share memory an error. ``transfers`` says, for each server, which way was chosen and why.

A checkpoint is one file of whole parameters and their optimizer state, whatever the placement
(``checkpoint`` says how it is put together and cut again).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any, cast

import torch

from stratagem.errors import CollectiveTimeoutError, InputError, ParameterServerError
from stratagem.shm import files as shm_files
from stratagem.shm import parameter_server as shared
from stratagem.strategies.parameter_server import checkpoint, wire
from stratagem.strategies.parameter_server.layout import Layout
from stratagem.strategies.parameter_server.optimizers import optimizer_spec
from stratagem.strategies.parameter_server.partitioners import Shard, shard_of
from stratagem.strategies.parameter_server.server import SERVICE
from stratagem.strategies.parameter_server.store import bucket_name
from stratagem.strategies.parameter_server.tracing import span, traced_calls
from stratagem.strategies.parameter_server.transport import Client, Security
from stratagem.trace.recorder import Recorder

logger = logging.getLogger(__name__)
DETACH_PATIENCE_SECONDS = 60.0  # how long a worker goes on telling a stuck server to let go of a file


class ShardedVariables:
    """A model's parameters as shards on parameter servers, seen from a chief or a worker."""

    def __init__(
        self,
        shards: Sequence[Shard],
        ps_addresses: Sequence[str],
        *,
        security: Security,
        rpc_timeout: float = 60.0,
        shared_memory: bool | None = None,
        task: str = "chief",
    ) -> None:
        if shared_memory not in (None, True, False):
            raise InputError(
                f"shared_memory must be None, True or False. Received: {shared_memory!r}. "
                "Pass None to use shared memory with servers on this host, False never to, "
                "True to insist."
            )
        self.shards = list(shards)
        self.rpc_timeout = rpc_timeout
        self.shared_memory = shared_memory
        self.task = task
        self._links: dict[int, shared.Link | str] = {}  # per server: the attached file, or why there is none
        self._transfers: dict[str, str] = {}
        self._attach_lock = threading.Lock()
        self._clients = [
            Client(address, SERVICE, security=security, task=f"ps:{i}") for i, address in enumerate(ps_addresses)
        ]
        self._by_ps: dict[int, list[Shard]] = {}
        for shard in self.shards:
            self._by_ps.setdefault(shard.ps, []).append(shard)
        self._layouts: dict[int, Layout] = {}
        self._pool = futures.ThreadPoolExecutor(max_workers=max(1, len(self._clients)), thread_name_prefix="ps-client")
        self.recorder: Recorder | None = None
        """A worker's trace (`tracing.py`): each pull and push, per server, while it records."""

    def _each_ps(self, call: Any) -> dict[int, Any]:
        """``call(ps_index, shards)`` for every server holding shards, in parallel; the first error wins."""
        if len(self._by_ps) == 1:
            ((ps, shards),) = self._by_ps.items()
            return {ps: call(ps, shards)}
        pending = {ps: self._pool.submit(call, ps, shards) for ps, shards in self._by_ps.items()}
        return {ps: future.result() for ps, future in pending.items()}

    # ---- chief ---------------------------------------------------------------------------------
    def create(self, parameters: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer | None) -> None:
        """Sends every shard's initial value and the optimizer to its parameter server."""
        spec = None if optimizer is None else optimizer_spec(optimizer)

        def call(ps: int, shards: list[Shard]) -> None:
            tensors = {s.name: shard_of(parameters[s.parameter].detach(), s) for s in shards}
            meta = {"optimizer": spec, "groups": {s.name: s.group for s in shards}}
            self._clients[ps].call("Create", "create", meta, tensors, timeout=self.rpc_timeout, wait_for_ready=True)

        self._each_ps(call)
        # Servers that hold no shard still get an empty Create, so a stale layout from an earlier job is cleared.
        for ps, client in enumerate(self._clients):
            if ps not in self._by_ps:
                client.call(
                    "Create",
                    "create",
                    {"optimizer": None, "groups": {}},
                    {},
                    timeout=self.rpc_timeout,
                    wait_for_ready=True,
                )

    def shutdown(self, timeout: float = 5.0) -> list[str]:
        """Tells every parameter server to stop; returns the ones that could not be told."""
        missed = []
        for client in self._clients:
            try:
                client.call("Shutdown", "shutdown", timeout=timeout)
            except (ParameterServerError, CollectiveTimeoutError) as exc:  # a server already gone is fine here
                logger.info("%s: %s", client.task, exc)
                missed.append(client.task)
        return missed

    # ---- workers -------------------------------------------------------------------------------
    def _layout(self, ps: int, shards: list[Shard], tensors: Mapping[str, torch.Tensor | None]) -> Layout:
        """The buckets of ``ps`` as its server keeps them (``Layout.build``), worked out once."""
        layout = self._layouts.get(ps)
        if layout is None:
            layout = self._layouts[ps] = Layout.build(ps, shards, tensors)
        return layout

    def arrange(self, parameters: Mapping[str, torch.Tensor]) -> None:
        """Moves ``parameters`` (a worker's own copy) into one buffer per bucket, in the servers' order.

        Each parameter held whole by one server becomes a view of its bucket's buffer (values kept),
        so a pull writes each bucket's bytes in one block instead of one copy per tensor. Parameters
        split over servers stay as they are. With a server on this host, a bucket of whole parameters
        lives in the pull area of the file shared with it, where the server writes the values: a pull
        then costs this worker no copy at all.
        """
        with torch.no_grad():
            for ps, shards in self._by_ps.items():
                layout = self._layout(ps, shards, parameters)
                on_cpu = all(parameters[s.parameter].is_cpu for s in shards)
                link = self._link(ps, layout) if on_cpu else None
                for index, bucket in enumerate(layout.buckets):
                    whole = [
                        parameters[s.parameter]
                        for s in bucket
                        if shard_of(parameters[s.parameter], s) is parameters[s.parameter]
                    ]
                    if not whole or not whole[0].is_cpu:
                        continue
                    if link is not None and len(whole) == len(bucket):
                        buffer = link.areas.pull[index]
                        buffer.copy_(torch._C._nn.flatten_dense_tensors([t.detach() for t in whole]))
                        link.residents.extend(whole)
                    elif len(whole) > 1:
                        buffer = torch._C._nn.flatten_dense_tensors([t.detach() for t in whole])
                    else:
                        continue
                    for tensor, view in zip(whole, torch._C._nn.unflatten_dense_tensors(buffer, whole)):
                        tensor.data = view

    def pull_into(self, parameters: Mapping[str, torch.Tensor]) -> None:
        """Copies the current value of every shard into ``parameters`` (one call per server, one block of
        bytes per bucket, written straight into the parameters)."""

        def call(ps: int, shards: list[Shard]) -> None:
            layout = self._layout(ps, shards, parameters)
            if self._pull_shared(ps, layout, parameters):
                return
            meta = {"layout": layout.fingerprint}
            destinations = layout.destinations(parameters)
            if destinations is not None:
                self._clients[ps].call_into("Pull", "pull", meta, destinations, timeout=self.rpc_timeout)
                return
            # Parameters on a GPU or not contiguous: receive the buckets, then copy them out.
            _, _, values = self._clients[ps].call("Pull", "pull", meta, timeout=self.rpc_timeout)
            if not layout.copy_out([values[bucket_name(i)] for i in range(len(layout.buckets))], parameters):
                raise ParameterServerError(
                    f"The parameters do not match the shards on {self._clients[ps].task}. Received: shapes "
                    f"{[[tuple(shard_of(parameters[s.parameter], s).shape) for s in b] for b in layout.buckets]!r:.200}, "
                    f"expected {[[tuple(x) for x in b] for b in layout.shapes]!r:.200}. Pull into the model "
                    "that was distributed."
                )

        with span(self.recorder, "wait", "pull"):
            self._each_ps(traced_calls(self.recorder, "pull", call, parameters, self._via))

    def push(self, gradients: Mapping[str, torch.Tensor | None]) -> None:
        """Sends the gradient rows of every shard to its server, which applies the optimizer.

        A parameter without a gradient (``None``: unused in this step) is not sent, so its
        optimizer state does not move, as torch's optimizers skip it.
        """

        def call(ps: int, shards: list[Shard]) -> None:
            layout = self._layout(ps, shards, gradients)
            if self._push_shared(ps, layout, gradients):
                return
            tensors: dict[str, torch.Tensor | wire.Flat] = {}
            for index, bucket in enumerate(layout.buckets):
                grads = list(map(gradients.get, layout.parameters[index]))
                if all(g is not None for g in grads):
                    present = cast("list[torch.Tensor]", grads)  # none is None: checked just above
                    parts = present if layout.whole[index] else [shard_of(g, s) for g, s in zip(present, bucket)]
                    tensors[bucket_name(index)] = wire.Flat(parts, staging=layout.staging[index])
                else:
                    tensors.update((s.name, shard_of(g, s)) for g, s in zip(grads, bucket) if g is not None)
            if tensors:
                self._clients[ps].call(
                    "Push", "push", {"layout": layout.fingerprint}, tensors, timeout=self.rpc_timeout, small_reply=True
                )

        with span(self.recorder, "wait", "push"):
            self._each_ps(traced_calls(self.recorder, "push", call, gradients, self._via))

    def _via(self, ps: int) -> str:
        return "shared memory" if isinstance(self._links.get(ps), shared.Link) else "gRPC"

    # ---- shared memory (a server on this host) --------------------------------------------------
    @property
    def transfers(self) -> dict[str, str]:
        """For each parameter server this task has pulled from or pushed to: how values travel, and why."""
        return dict(self._transfers)

    def _link(self, ps: int, layout: Layout) -> shared.Link | None:
        """The file shared with server ``ps``, attached at the first call; None when values go over gRPC."""
        link = self._links.get(ps)
        if link is None:
            with self._attach_lock:
                link = self._links.get(ps)
                if link is None:
                    link = self._attach(ps, layout)
                    if link is not None:
                        self._links[ps] = link
        return link if isinstance(link, shared.Link) else None

    def _attach(self, ps: int, layout: Layout) -> shared.Link | str | None:
        """Offers ``ps`` a new file; returns it attached, why values go over gRPC instead, or None when the
        server holds other shards than this worker expects (the call that follows says so; ask again later)."""
        if self.shared_memory is False:
            return self._over_grpc(ps, shared.TURNED_OFF, warn=False)
        why = shared.eligible()
        made = why or shared.make_file(layout.sizes)
        if isinstance(made, str):
            return self._over_grpc(ps, made, warn=why is None)  # on Linux with a /dev/shm: worth a warning
        path, nonce, mapping = made
        client = self._clients[ps]
        try:
            op, meta, _ = client.call(
                "Attach",
                "attach",
                shared.offer(path, nonce, self.task, layout.fingerprint),
                timeout=self.rpc_timeout,
                small_reply=True,
            )
        except BaseException:
            mapping.close()
            raise
        finally:
            shm_files.unlink(path)  # the server has mapped it (and may have removed it already), or never will
        if op != "attached":
            mapping.close()
            if meta.get("retry"):
                return None
            return self._over_grpc(ps, str(meta.get("why")), warn=bool(meta.get("same_host")))
        link = shared.Link(
            shared.Areas(mapping, layout.sizes),
            meta["segment"],
            server=(meta["pid"], meta["start"]) if meta.get("counters") else None,
        )
        size = shared.describe_bytes(len(mapping))
        self._transfers[client.task] = (
            f"shared memory: {client.task} runs on this host ({size} in /dev/shm, one "
            "copy each way instead of gRPC messages)"
        )
        logger.info("%s: pulls from and pushes to %s through shared memory (%s)", self.task, client.task, size)
        return link

    def _over_grpc(self, ps: int, why: str, *, warn: bool) -> str:
        task = self._clients[ps].task
        if self.shared_memory is True:
            raise ParameterServerError(
                f"shared_memory=True, but {self.task} cannot share memory with {task}. Received: {why}. Run "
                f"them on one host with room in /dev/shm, or pass shared_memory=None to send values over gRPC there."
            )
        self._transfers[task] = f"gRPC: {why}"
        if warn and self.shared_memory is None:
            logger.warning(
                "%s: values to and from %s go over gRPC, which is slower on one host, because %s. "
                "Give the tasks one /dev/shm with room for the file (Docker: --ipc=host, --shm-size), "
                "or pass shared_memory=False to say gRPC is meant.",
                self.task,
                task,
                why,
            )
        else:
            logger.info("%s: values to and from %s go over gRPC: %s", self.task, task, why)
        return why

    def _forget(self, ps: int, link: shared.Link, *, failed: bool = False) -> None:
        """Drops the file: the server no longer knows it (restarted, or the chief created the shards anew), or a
        request failed (``failed``). A new one is attached at the next call. After a failure the server may
        still answer late and write the values area, so parameters living there move out first."""
        logger.info(
            "%s: %s %s; attaching a new shared file at the next call",
            self.task,
            self._clients[ps].task,
            "did not answer a request through the shared file" if failed else "let go of the shared file",
        )
        if self._links.get(ps) is link:
            del self._links[ps]
        if failed:
            with torch.no_grad():
                for tensor in link.residents:
                    tensor.data = tensor.data.clone()
            # The server may be stuck rather than gone; told in the background, it lets go of the file once it
            # answers, instead of keeping it mapped until this worker exits.
            threading.Thread(
                target=self._detach,
                args=(ps, link.segment, max(5.0, self.rpc_timeout)),
                kwargs={"patience": DETACH_PATIENCE_SECONDS},
                name=f"ps-detach-{ps}",
                daemon=True,
            ).start()
        link.residents.clear()
        link.areas.close()

    def _detach(self, ps: int, segment: str, timeout: float, *, patience: float = 0.0) -> None:
        """Tells ``ps`` to let go of a file. A server that is gone or does not answer in time needs no telling: it
        lets go of a worker's files when the shards are created anew, when it stops, and when the worker exits.
        A call that timed out is made again for ``patience`` seconds (a stuck server that wakes up still hears)."""
        give_up = time.monotonic() + patience
        while True:
            try:
                self._clients[ps].call("Detach", "detach", {"segment": segment}, timeout=timeout, small_reply=True)
                return
            except (ParameterServerError, CollectiveTimeoutError, ValueError) as exc:  # ValueError: channel closed
                if not isinstance(exc, CollectiveTimeoutError) or time.monotonic() >= give_up:
                    logger.debug("%s: detach from %s: %s", self.task, self._clients[ps].task, exc)
                    return

    def _pull_shared(self, ps: int, layout: Layout, parameters: Mapping[str, torch.Tensor]) -> bool:
        """A pull from ``ps`` through the shared file; False when it must go over gRPC."""
        link = self._link(ps, layout)
        if link is None:
            return False
        with link.lock:
            if not self._ask(ps, link, layout, shared.PULL, ()):
                return False
            destinations = layout.destinations(parameters)
            if destinations is not None:
                if any(
                    destinations[bucket_name(i)].numel != n or destinations[bucket_name(i)].dtype != dtype
                    for i, (dtype, n) in enumerate(layout.sizes)
                ):
                    return False  # not this server's shards: the gRPC pull says what does not match
                for index in range(len(layout.buckets)):
                    destinations[bucket_name(index)].read_from(link.areas.pull[index])
                return True
            # Parameters on a GPU or not contiguous. Not this server's shards: the gRPC pull says what does not match.
            return layout.copy_out(link.areas.pull, parameters)

    def _push_shared(self, ps: int, layout: Layout, gradients: Mapping[str, torch.Tensor | None]) -> bool:
        """A push to ``ps`` through the shared file; False when it must go over gRPC (part of a bucket)."""
        link = self._link(ps, layout)
        if link is None:
            return False
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        indices: list[int] = []
        for index, bucket in enumerate(layout.buckets):
            grads = list(map(gradients.get, layout.parameters[index]))
            if all(g is None for g in grads):
                continue
            if any(g is None for g in grads):
                return False  # the server must leave the others' optimizer state alone: shard by shard, over gRPC
            present = cast("list[torch.Tensor]", grads)  # none is None: checked just above
            parts = present if layout.whole[index] else [shard_of(g, s) for g, s in zip(present, bucket)]
            dtype = layout.sizes[index][0]
            if [p.shape for p in parts] != layout.shapes[index] or any(p.dtype != dtype for p in parts):
                return False  # not this server's shards: the gRPC push says what does not match
            views = link.push_views.get(index)
            if views is None:
                views = link.push_views[index] = torch._C._nn.unflatten_dense_tensors(link.areas.push[index], parts)
            targets.extend(views)
            sources.extend(parts)
            indices.append(index)
        if not indices:
            return True
        with link.lock:
            shared.copy_all(targets, sources)
            return self._ask(ps, link, layout, shared.PUSH, indices)  # False: not applied, it goes over gRPC now

    def _ask(self, ps: int, link: shared.Link, layout: Layout, op: int, buckets: Sequence[int]) -> bool:
        """Has ``ps`` pull into or push from the file (under ``link.lock``): through its counters, or by a small
        gRPC call. False when the server no longer knows the file (attach again); the link is dropped then,
        and when the request fails, since neither side knows where the other stands."""
        client = self._clients[ps]
        what = "pull" if op == shared.PULL else "push"
        try:
            if link.server is not None and len(buckets) <= shared.MAX_LISTED:
                done = shared.request(link, op, buckets, timeout=self.rpc_timeout, server=client.task, what=what)
            else:
                method = "PullShared" if op == shared.PULL else "PushShared"
                meta = {"layout": layout.fingerprint, "segment": link.segment, "buckets": list(buckets)}
                done = client.call(method, what, meta, timeout=self.rpc_timeout, small_reply=True)[0] != "unattached"
        except BaseException:
            self._forget(ps, link, failed=True)
            raise
        if not done:
            self._forget(ps, link)
        return done

    # ---- checkpoints (the format: ``checkpoint``) --------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Every parameter and its optimizer state, shards put back together."""
        replies = self._each_ps(lambda ps, shards: self._clients[ps].call("Save", "save", timeout=self.rpc_timeout))
        return checkpoint.join_state(self.shards, replies)

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Puts parameters and optimizer state back on the servers (any placement)."""
        checkpoint.check_covers(state, self.shards)

        def call(ps: int, shards: list[Shard]) -> None:
            tensors, scalars = checkpoint.shard_state(state, shards)
            self._clients[ps].call("Load", "load", {"scalars": scalars}, tensors, timeout=self.rpc_timeout)

        self._each_ps(call)

    def save(self, path: str | Path) -> None:
        """Writes ``state()`` to ``path`` (through a temporary file, so a crash leaves the old one)."""
        checkpoint.write(self.state(), path)

    def restore(self, path: str | Path) -> None:
        """Loads a checkpoint written by ``save``, after checking the checksums of its archive.

        Raises:
            InputError: no file at ``path``, it holds objects other than tensors, it is not a
                parameter-server checkpoint, or not of this model.
            CorruptCheckpointError: the file is damaged or torch cannot read it.
        """
        self.load_state(checkpoint.read(path))

    def close(self) -> None:
        for ps, link in list(self._links.items()):
            if isinstance(link, shared.Link):
                self._detach(ps, link.segment, min(5.0, self.rpc_timeout))
                link.areas.close()
        self._links.clear()
        self._pool.shutdown(wait=False)
        for client in self._clients:
            client.close()


def transfers_choice(seen: Mapping[str, str], switched_off: str | None, shared_memory: bool | None) -> str:
    """How values travel between this process's tasks and the parameter servers, in a word (`explain()`): from what
    was decided so far (`seen`: "task -> ps:i" -> how, as `ShardedVariables.transfers` says), else from the settings
    (`switched_off`: why STRATAGEM_SHARED_MEMORY turned shared memory off, or None)."""
    ways = {how.split(":")[0] for how in seen.values()}
    if not ways:
        if switched_off is not None:
            return "gRPC"
        return {None: "shared memory on one host, else gRPC", False: "gRPC", True: "shared memory (required)"}[
            shared_memory
        ]
    return " and ".join(sorted(ways))


def transfers_reason(seen: Mapping[str, str], switched_off: str | None, shared_memory: bool | None) -> str:
    """Why values travel as `transfers_choice` says."""
    if not seen and switched_off is not None:
        return f"shared memory {switched_off}, so every value travels over gRPC"
    if not seen:
        return (
            f"shared_memory={shared_memory}; each worker decides at its first pull from each parameter "
            "server (explain() on a task after it has pulled shows the outcome)"
        )
    return "; ".join(f"{pair}: {how}" for pair, how in sorted(seen.items()))
