"""gRPC plumbing shared by parameter servers and workers: authenticated servers and clients.

Every method is a bidirectional stream of raw byte chunks (no protoc code): a request is one
``wire`` message cut into chunks, and so is the reply. A server interceptor reads the call's
metadata before anything else: a call without the cluster token, or with a wrong one, is refused
with ``UNAUTHENTICATED`` before a byte of its request is read, so nothing from an unknown peer is
ever parsed. Servers listen on 127.0.0.1 unless given an address; TLS is on when a certificate
and key are given (clients then need the certificate of the authority that signed them).

    >>> server = Server("stratagem.Echo", {"Echo": lambda op, meta, tensors: (op, meta, tensors)},
    ...                 security=Security(token="t"))        # doctest: +SKIP
    >>> client = Client("127.0.0.1:%d" % server.port, "stratagem.Echo", security=Security(token="t"),
    ...                 task="echo:0")                      # doctest: +SKIP
"""

from __future__ import annotations

import errno
import hmac
import itertools
import logging
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from stratagem.errors import (
    CollectiveTimeoutError,
    InputError,
    ParameterServerError,
    WireFormatError,
)
from stratagem.strategies.parameter_server import wire

if TYPE_CHECKING:
    import grpc

logger = logging.getLogger(__name__)

TOKEN_KEY = "stratagem-cluster-token"
SINGLE = "_1"
"""Suffix of the method that takes a request of one piece (unary request, streamed reply)."""
UNARY = "_11"
"""Suffix of the method that takes a request of one piece and answers with one (unary request and reply)."""
MAX_MESSAGE_BYTES = wire.CHUNK_BYTES + (1 << 20)
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
_SERVER_OPTIONS = _CHANNEL_OPTIONS + [
    # gRPC sets SO_REUSEPORT by default, so a second server (a stale task of an earlier job) could bind the
    # same port and take half of the calls: bind exclusively, so the second one is told the port is taken.
    ("grpc.so_reuseport", 0),
]
_CLIENT_OPTIONS = _CHANNEL_OPTIONS + [
    # A streamed reply is read by the thread that asks for it, instead of a thread grpc-python starts per
    # call (measured: a 2 MB pull from 1.5 to 1.1 ms of bare gRPC). The spelling of
    # grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, so grpc loads with the first server or client.
    ("SingleThreadedUnaryStream", 1),
    # A restarted task is found again within about a second (gRPC's default backoff grows to 2 minutes).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # gRPC shares connections ("subchannels") between every channel of the process to one address, with
    # their reconnect back-off: a new client of a task restarted on its old port inherited the dead
    # connection's failure and was refused at once ("Connection refused"). Each client keeps its own.
    ("grpc.use_local_subchannel_pool", 1),
]
# A handler gets (op, meta, tensors) and returns (op, meta, tensors) for the reply, or the reply's
# pieces (wire.encode_chunks or wire.stream_chunks, or cut as they are sent: a parameter server's pull).
Reply = tuple[str, Any, Mapping[str, torch.Tensor]] | Iterable[bytes]
Handler = Callable[[str, Any, dict[str, torch.Tensor]], Reply]


@dataclass(frozen=True)
class Streaming:
    """A handler that reads the request's pieces itself (``wire.decode_into``) instead of a decoded message."""

    handler: Callable[[Iterator[bytes]], Reply]


SMALL_HEADER_BYTES = 64 << 10
"""The header of a request that carries no more than a few names and numbers (a ping, an attach)."""


@dataclass(frozen=True)
class Limit:
    """The most a request to one method may carry, checked on its first bytes and its header, before the rest
    is read (``wire.read_message``). A number, or a function giving it for each call (what a server holds
    decides what a push may carry). A ``Streaming`` handler checks its own."""

    header_bytes: int | Callable[[], int] = SMALL_HEADER_BYTES
    payload_bytes: int | Callable[[], int] = 0

    def resolve(self) -> tuple[int, int]:
        """``(header bytes, payload bytes)`` for a call now."""
        return tuple(v() if callable(v) else v for v in (self.header_bytes, self.payload_bytes))  # type: ignore[return-value]


def memory_ceiling() -> int:
    """Bytes of tensors a request may carry when nothing smaller bounds it (a model created on a parameter
    server, a scheduled function's arguments): half this machine's memory, since the receiver must hold them and
    more (the optimizer's state, the training)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (AttributeError, OSError, ValueError):
        return 1 << 36


LARGE = Limit(wire.MAX_HEADER_BYTES, memory_ceiling)
"""For a method whose requests nothing smaller bounds."""
SMALL = Limit()
"""For a method whose requests carry a few names and numbers and no tensors."""


@dataclass(frozen=True, kw_only=True)
class Security:
    """The cluster token and, optionally, TLS files (PEM paths)."""

    token: str
    """Shared secret every call must carry; ``stratagem launch`` sets ``STRATAGEM_CLUSTER_TOKEN``."""
    certificate: str | None = None
    """Server certificate (servers) and the authority clients trust (clients)."""
    private_key: str | None = None
    """The server's private key; with ``certificate`` it turns TLS on for servers."""
    server_name: str | None = None
    """Name the certificate was issued for, when it is not the address clients dial."""

    def __post_init__(self) -> None:
        if not isinstance(self.token, str) or not self.token:
            raise InputError(
                f"The cluster token is empty. Received: token={self.token!r}. Pass cluster_token=..., or run "
                "under `stratagem launch`, which sets STRATAGEM_CLUSTER_TOKEN."
            )
        if (self.private_key is None) != (self.certificate is None) and self.private_key is not None:
            raise InputError(
                f"A private key needs its certificate. Received: private_key={self.private_key!r}, certificate=None. "
                "Pass both certificate= and private_key= for TLS."
            )
        for path in (self.certificate, self.private_key):
            if path is not None and not Path(path).is_file():
                raise InputError(f"TLS file not found. Received: {path!r}. Pass the path of a PEM file.")

    @property
    def tls(self) -> bool:
        return self.certificate is not None


def _refuse(message: str, kind: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``kind`` (streaming or not) that refuses the call without reading it."""
    import grpc

    def abort(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if kind is not None and not kind.request_streaming:
        return (
            grpc.unary_stream_rpc_method_handler(abort)
            if kind.response_streaming
            else grpc.unary_unary_rpc_method_handler(abort)
        )
    return (
        grpc.stream_unary_rpc_method_handler(abort)
        if kind is not None and not kind.response_streaming
        else grpc.stream_stream_rpc_method_handler(abort)
    )


def _token_interceptor(token: str) -> grpc.ServerInterceptor:
    """An interceptor that refuses a call whose metadata lacks the cluster token before its handler runs.

    Built here rather than at module level because its base class is grpc's, which loads only with a server."""
    import grpc

    class TokenInterceptor(grpc.ServerInterceptor):
        def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
            return _check_token(token.encode(), continuation, details)

    return TokenInterceptor()


def _check_token(expected: bytes, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
    given = dict(details.invocation_metadata or ()).get(TOKEN_KEY)
    if given is None:
        logger.warning("refused %s: no cluster token", details.method)
        return _refuse(
            f"No cluster token. Received: a call to {details.method} without '{TOKEN_KEY}' metadata. "
            "Connect with the job's cluster token.",
            continuation(details),
        )
    given_bytes = given.encode() if isinstance(given, str) else bytes(given)
    if not hmac.compare_digest(given_bytes, expected):
        logger.warning("refused %s: wrong cluster token", details.method)
        return _refuse(
            f"Wrong cluster token. Received: a call to {details.method} with a token that does not "
            "match this job's. Use the STRATAGEM_CLUSTER_TOKEN of this job.",
            continuation(details),
        )
    return continuation(details)


class Server:
    """A gRPC server of one service whose methods take and return ``wire`` messages.

    ``handlers`` maps method names to ``Handler``s; ``limits`` says what a request to each may carry
    (a method left out takes what ``default_limit`` says: by default up to ``memory_ceiling()``
    bytes of tensors). A request that is not a well-formed
    message, or carries more than its method takes, is answered with ``INVALID_ARGUMENT`` as soon as
    its first bytes or its header show it, before the rest is read; an exception in a handler with
    ``INTERNAL``; the server keeps serving either way.
    """

    def __init__(
        self,
        service: str,
        handlers: Mapping[str, Handler | Streaming],
        *,
        security: Security,
        address: str = "127.0.0.1:0",
        max_workers: int = 8,
        limits: Mapping[str, Limit] | None = None,
        default_limit: Limit | None = None,
    ) -> None:
        self.service = service
        if security.tls and security.private_key is None:
            raise InputError(
                f"A TLS server needs its private key. Received: certificate={security.certificate!r}, private_key=None. "
                "Pass private_key= with certificate= on every task that serves (parameter servers and workers)."
            )
        import grpc

        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=service),
            interceptors=[_token_interceptor(security.token)],
            options=_SERVER_OPTIONS,
        )
        methods = {}
        for name, handler in handlers.items():
            call = self._wrap(name, handler, (limits or {}).get(name, default_limit or LARGE))
            methods[name] = grpc.stream_stream_rpc_method_handler(call)
            # A request of one piece comes as a unary request: gRPC then needs no thread to feed it. When the
            # caller expects a short reply, it comes as a unary call, one batch each way (a 2 MB push over bare
            # gRPC: 1.0 ms as a unary call, 1.7 ms with a streamed reply).
            methods[name + SINGLE] = grpc.unary_stream_rpc_method_handler(
                lambda request, context, call=call: call(iter((request,)), context)
            )
            methods[name + UNARY] = grpc.unary_unary_rpc_method_handler(
                lambda request, context, call=call: _one_piece(call(iter((request,)), context), context)
            )
        self._server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, methods)])
        try:
            if security.tls:
                assert security.private_key is not None and security.certificate is not None  # tls; key checked above
                credentials = grpc.ssl_server_credentials(
                    [(Path(security.private_key).read_bytes(), Path(security.certificate).read_bytes())]
                )
                self.port = self._server.add_secure_port(address, credentials)
            else:
                self.port = self._server.add_insecure_port(address)
        except RuntimeError:  # grpcio raises where older versions returned port 0
            self.port = 0
        if self.port == 0:
            raise ParameterServerError(
                f"Could not listen at {address}: {_why_not_listening(address)}. Received: "
                f"address={address!r}. Stop the process that holds the port, or pass a "
                "free host:port (port 0 picks one)."
            )
        self.address = f"{address.rsplit(':', 1)[0]}:{self.port}"
        self._server.start()
        logger.info("%s serving on %s (tls=%s)", service, self.address, security.tls)

    def _wrap(
        self, name: str, handler: Handler | Streaming, limit: Limit
    ) -> Callable[[Iterator[bytes], grpc.ServicerContext], Iterator[bytes]]:
        import grpc

        def call(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
            try:
                if isinstance(handler, Streaming):
                    reply = handler.handler(requests)
                else:
                    header_bytes, payload_bytes = limit.resolve()
                    op, meta, tensors = wire.read_message(
                        requests, max_header_bytes=header_bytes, max_payload_bytes=payload_bytes
                    )
                    reply = handler(op, meta, tensors)
            except WireFormatError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except Exception as exc:  # the caller gets the error; the server goes on serving
                logger.exception("%s/%s failed", self.service, name)
                context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            yield from wire.encode_chunks(*reply) if isinstance(reply, tuple) else reply

        return call

    def stop(self, grace: float = 0.5) -> None:
        """Stops serving (in-flight calls get ``grace`` seconds); waits at most ``grace + 5`` s for gRPC to finish."""
        if not self._server.stop(grace).wait(grace + 5):
            logger.warning(
                "%s at %s had not finished stopping after %g s; going on", self.service, self.address, grace + 5
            )


def _why_not_listening(address: str) -> str:
    """Why gRPC could not bind ``address``, found by binding it once more (gRPC's own reason goes to its log only)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: a port in TIME_WAIT is free
            probe.bind((host.strip("[]"), int(port)))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return (
                f"port {port} is taken (another process listens there, perhaps a task of an earlier job that "
                f"still runs: `ss -ltnp 'sport = :{port}'` names it)"
            )
        return f"{exc.strerror or exc}"
    except ValueError:
        return "not a host:port"
    return "gRPC refused the address"


def _one_piece(pieces: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
    """A reply's pieces as the one message of a unary reply."""
    import grpc

    reply = list(pieces)
    if len(reply) == 1:
        return reply[0]
    size = sum(len(piece) for piece in reply)
    if size > MAX_MESSAGE_BYTES:
        context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"The reply is too large for a unary call. Received: a reply of {size} bytes, at most "
            f"{MAX_MESSAGE_BYTES} fit. Call without small_reply=True, so the reply is streamed.",
        )
    return b"".join(reply)


class CallTracker(Protocol):
    """Follows the calls of a ``Client`` while they run, so another thread can cut them (``heartbeat.Cancellation``)."""

    def track(self, call: Any) -> None: ...

    def forget(self, call: Any) -> None: ...


class Client:
    """Calls the methods of one remote ``Server``; errors name the task at the other end."""

    def __init__(self, address: str, service: str, *, security: Security, task: str) -> None:
        self.address = address
        self.task = task
        self._service = service
        import grpc

        if security.tls:
            assert security.certificate is not None  # what tls means
            credentials = grpc.ssl_channel_credentials(root_certificates=Path(security.certificate).read_bytes())
            options: list[tuple[str, Any]] = list(_CLIENT_OPTIONS)
            if security.server_name:
                options.append(("grpc.ssl_target_name_override", security.server_name))
            self._channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=_CLIENT_OPTIONS)
        self._metadata = ((TOKEN_KEY, security.token),)
        self._methods: dict[str, Any] = {}

    def call(
        self,
        method: str,
        op: str,
        meta: Any = None,
        tensors: Mapping[str, torch.Tensor | wire.Flat] | None = None,
        *,
        timeout: float,
        wait_for_ready: bool = False,
        small_reply: bool = False,
        cancellation: CallTracker | None = None,
    ) -> tuple[str, Any, dict[str, torch.Tensor]]:
        """Sends one message to ``method`` and returns the decoded reply.

        ``small_reply``: the caller knows the reply fits one piece (an acknowledgement), so a request
        of one piece goes as a unary call, the cheapest kind. ``cancellation``: another thread may cut
        the call (the reply is then streamed, since a streamed call is one that can be cut).

        Raises ``ParameterServerError`` naming the task when it cannot be reached or refuses the
        call, and ``CollectiveTimeoutError`` when no reply came within ``timeout`` seconds.
        """
        import grpc

        try:
            if cancellation is None:
                replies = self._send(
                    method, wire.stream_chunks(op, meta, tensors), timeout, wait_for_ready, small_reply
                )
                return wire.decode(wire.join_chunks(replies))
            call = self._send(method, wire.stream_chunks(op, meta, tensors), timeout, wait_for_ready)
            cancellation.track(call)
            try:
                return wire.decode(wire.join_chunks(call))
            finally:
                cancellation.forget(call)
        except grpc.RpcError as exc:
            raise rpc_error(exc, self.task, self.address, method, timeout) from None

    def _stub(self, kind: str, method: str) -> Any:
        stub = self._methods.get(method)
        if stub is None:
            stub = self._methods[method] = getattr(self._channel, kind)(f"/{self._service}/{method}")
        return stub

    def _send(
        self, method: str, pieces: Iterator[bytes], timeout: float, wait_for_ready: bool, small_reply: bool = False
    ) -> Iterator[bytes]:
        """Starts a call with the request ``pieces`` (made while gRPC sends them); returns the reply's pieces."""
        first = next(pieces)
        second = next(pieces, None)
        if second is None and small_reply:
            reply = self._stub("unary_unary", method + UNARY)(
                first, timeout=timeout, metadata=self._metadata, wait_for_ready=wait_for_ready
            )
            return iter((reply,))
        if second is None:  # one piece: a unary request, which costs gRPC no thread to feed
            return self._stub("unary_stream", method + SINGLE)(
                first, timeout=timeout, metadata=self._metadata, wait_for_ready=wait_for_ready
            )
        return self._stub("stream_stream", method)(
            itertools.chain((first, second), pieces),
            timeout=timeout,
            metadata=self._metadata,
            wait_for_ready=wait_for_ready,
        )

    def call_into(
        self, method: str, op: str, meta: Any, destinations: Mapping[str, torch.Tensor | wire.Flat], *, timeout: float
    ) -> tuple[str, Any]:
        """Like ``call``, but the reply's tensors are written straight into ``destinations`` (see ``wire.decode_into``)."""
        import grpc

        try:
            replies = self._send(method, wire.stream_chunks(op, meta), timeout, False)
            reply_op, reply_meta, _ = wire.decode_into(replies, destinations)
            return reply_op, reply_meta
        except grpc.RpcError as exc:
            raise rpc_error(exc, self.task, self.address, method, timeout) from None

    def wait_ready(self, timeout: float) -> bool:
        """True once the channel is connected, False after ``timeout`` seconds without it."""
        import grpc

        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
            return True
        except grpc.FutureTimeoutError:
            return False

    def close(self) -> None:
        self._channel.close()


def task_lost(exc: BaseException) -> bool:
    """True when ``exc`` is a failed call that says its task went away (as opposed to refusing the call):
    UNAVAILABLE when its port no longer answers, CANCELLED when the server stopped while the call was in
    flight (gRPC aborts the calls of a server that stops) or when the coordinator cut it because the task
    stopped answering its heartbeat (``heartbeat.Cancellation``); stratagem never cancels a call for another reason."""
    import grpc

    return getattr(exc, "code", None) in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def rpc_error(exc: grpc.RpcError, task: str, address: str, method: str, timeout: float) -> Exception:
    """The stratagem error for a failed call to ``task``."""
    import grpc

    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return CollectiveTimeoutError(
            f"{task} at {address} did not answer {method} within {timeout:g} s. Received: DEADLINE_EXCEEDED. "
            f"Check that {task} is alive and not overloaded, or raise the timeout."
        )
    error = ParameterServerError(
        f"{task} at {address} failed {method}. Received: {code.name if code else 'error'}: {str(details).rstrip('.')}. "
        f"Check that {task} is running with this job's cluster token (its log says why it stopped)."
    )
    error.code = code  # type: ignore[attr-defined]
    error.task = task  # type: ignore[attr-defined]
    return error
