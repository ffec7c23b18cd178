"""The parameter-server transport refuses unauthenticated and malformed calls and keeps serving; TLS works."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import struct

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from stratagem.errors import InputError, ParameterServerError
from stratagem.strategies.parameter_server import transport, wire
from stratagem.strategies.parameter_server.transport import Client, Security, Server

SERVICE = "stratagem.test.Echo"
seen: list[str] = []


def _echo(op, meta, tensors):
    seen.append(op)  # proves whether a handler ran at all
    return op, meta, {name: t * 2 for name, t in tensors.items()}


@pytest.fixture
def server():
    seen.clear()
    srv = Server(SERVICE, {"Echo": _echo}, security=Security(token="right"))
    yield srv
    srv.stop()


def _assert_still_serving(srv):
    client = Client(srv.address, SERVICE, security=Security(token="right"), task="echo:0")
    _, meta, got = client.call("Echo", "ok", {"n": 1}, {"x": torch.ones(3)}, timeout=10)
    assert meta == {"n": 1} and torch.equal(got["x"], torch.full((3,), 2.0))
    client.close()


@pytest.fixture
def self_signed(tmp_path):
    """A self-signed certificate for 127.0.0.1 and localhost, and its key (PEM files)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@pytest.mark.timeout(30)
def test_listens_on_loopback_by_default(server):
    assert server.address.startswith("127.0.0.1:")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("numel", "small_reply"),
    [(2, False), (2, True), (wire.CHUNK_BYTES // 4 + 10, False)],
    ids=["one-piece", "unary", "streamed"],
)
def test_wrong_token_is_refused_before_the_handler_runs(server, numel, small_reply):
    client = Client(server.address, SERVICE, security=Security(token="wrong"), task="echo:0")
    with pytest.raises(ParameterServerError, match="UNAUTHENTICATED: Wrong cluster token") as info:
        client.call("Echo", "attack", None, {"x": torch.ones(numel)}, timeout=10, small_reply=small_reply)
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED and "echo:0" in str(info.value)
    assert seen == []
    _assert_still_serving(server)


@pytest.mark.timeout(30)
def test_missing_token_is_refused_and_request_never_read(server):
    channel = grpc.insecure_channel(server.address)
    consumed = []

    def requests():
        consumed.append(1)
        yield b"this is not even a message"

    stub = channel.stream_stream(f"/{SERVICE}/Echo")
    with pytest.raises(grpc.RpcError) as info:
        list(stub(requests(), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "No cluster token" in info.value.details()
    single = channel.unary_stream(f"/{SERVICE}/Echo{transport.SINGLE}")  # the one-piece form of the method
    with pytest.raises(grpc.RpcError) as info:
        list(single(b"this is not even a message", timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "No cluster token" in info.value.details()
    unary = channel.unary_unary(f"/{SERVICE}/Echo{transport.UNARY}")  # one piece each way
    with pytest.raises(grpc.RpcError) as info:
        unary(b"this is not even a message", timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "No cluster token" in info.value.details()
    assert seen == []
    channel.close()
    _assert_still_serving(server)


@pytest.mark.timeout(30)
def test_malformed_message_gets_invalid_argument_and_server_keeps_serving(server):
    channel = grpc.insecure_channel(server.address)
    stub = channel.stream_stream(f"/{SERVICE}/Echo")
    forged = struct.pack(">4sI", b"SGW1", 2) + b"{}"
    single = channel.unary_stream(f"/{SERVICE}/Echo{transport.SINGLE}")
    unary = channel.unary_unary(f"/{SERVICE}/Echo{transport.UNARY}")
    for payload in (b"\x80\x04pickled", forged):
        for call in (
            lambda p: list(stub(iter([p]), timeout=10, metadata=((transport.TOKEN_KEY, "right"),))),
            lambda p: list(single(p, timeout=10, metadata=((transport.TOKEN_KEY, "right"),))),
            lambda p: unary(p, timeout=10, metadata=((transport.TOKEN_KEY, "right"),)),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call(payload)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "Malformed parameter-server message" in info.value.details()
    assert seen == []
    channel.close()
    _assert_still_serving(server)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("numel", [3, wire.CHUNK_BYTES // 8], ids=["one-piece", "reply-of-two-pieces"])
def test_a_unary_call_returns_the_whole_reply(server, numel):
    # The echo doubles its input, so the reply of a 1/2-chunk float64 request is a chunk and more:
    # two pieces, joined into the one message of a unary reply.
    client = Client(server.address, SERVICE, security=Security(token="right"), task="echo:0")
    x = torch.arange(numel, dtype=torch.float64)
    _, meta, got = client.call("Echo", "ok", {"n": 2}, {"x": x, "y": x}, timeout=10, small_reply=True)
    assert meta == {"n": 2} and torch.equal(got["x"], x * 2) and torch.equal(got["y"], x * 2)
    client.close()


@pytest.mark.timeout(30)
def test_a_reply_too_large_for_a_unary_call_is_refused_with_the_fix():
    def grow(op, meta, tensors):  # a short request, a reply larger than one gRPC message may be
        return op, meta, {"big": torch.zeros(transport.MAX_MESSAGE_BYTES // 4 + 1)}

    srv = Server(SERVICE, {"Grow": grow, "Echo": _echo}, security=Security(token="right"))
    client = Client(srv.address, SERVICE, security=Security(token="right"), task="grow:0")
    try:
        with pytest.raises(ParameterServerError, match="RESOURCE_EXHAUSTED: The reply is too large") as info:
            client.call("Grow", "big", timeout=10, small_reply=True)
        assert "without small_reply=True" in str(info.value) and "grow:0" in str(info.value)
        assert client.call("Grow", "big", timeout=10)[2]["big"].numel() == transport.MAX_MESSAGE_BYTES // 4 + 1
        _assert_still_serving(srv)
    finally:
        client.close()
        srv.stop()


@pytest.mark.timeout(30)
def test_unreachable_task_is_named():
    from stratagem.cluster import free_ports

    client = Client(f"127.0.0.1:{free_ports(1)[0]}", SERVICE, security=Security(token="t"), task="ps:3")
    with pytest.raises(ParameterServerError, match="ps:3 at 127.0.0.1:.* failed Echo. Received: UNAVAILABLE"):
        client.call("Echo", "x", timeout=5)


def test_bad_security_settings_are_refused(tmp_path):
    with pytest.raises(InputError, match="cluster token is empty"):
        Security(token="")
    with pytest.raises(InputError, match="TLS file not found"):
        Security(token="t", certificate=str(tmp_path / "missing.pem"))
    with pytest.raises(InputError, match="private key needs its certificate"):
        Security(token="t", private_key=str(tmp_path / "key.pem"))


def test_a_tls_server_without_its_private_key_is_refused(self_signed):
    # A client's settings (the authority only) once reached Path(None) in the server: a bare TypeError.
    cert, _ = self_signed
    with pytest.raises(InputError, match="A TLS server needs its private key. Received: certificate="):
        Server(SERVICE, {"Echo": _echo}, security=Security(token="t", certificate=str(cert)))


@pytest.mark.timeout(60)
def test_tls_round_trip_with_a_self_signed_certificate(self_signed):
    cert, key = self_signed
    security = Security(token="right", certificate=str(cert), private_key=str(key))
    srv = Server(SERVICE, {"Echo": _echo}, security=security)
    try:
        client = Client(srv.address, SERVICE, security=Security(token="right", certificate=str(cert)), task="echo:0")
        _, _, got = client.call("Echo", "tls", None, {"x": torch.arange(4.0)}, timeout=20)
        assert torch.equal(got["x"], torch.arange(4.0) * 2)
        # A plaintext client cannot talk to a TLS server.
        plain = Client(srv.address, SERVICE, security=Security(token="right"), task="echo:0")
        with pytest.raises(ParameterServerError, match="UNAVAILABLE"):
            plain.call("Echo", "plain", timeout=5)
    finally:
        srv.stop()


def test_wire_error_from_handler_is_invalid_argument():
    def bad(op, meta, tensors):
        raise wire.WireFormatError("bad shard name. Received: x. Y.")

    srv = Server(SERVICE, {"Echo": bad}, security=Security(token="t"))
    try:
        client = Client(srv.address, SERVICE, security=Security(token="t"), task="ps:0")
        with pytest.raises(ParameterServerError, match="INVALID_ARGUMENT: bad shard name"):
            client.call("Echo", "x", timeout=10)
    finally:
        srv.stop()


@pytest.mark.timeout(60)
def test_training_over_tls(self_signed):
    import torch.nn.functional as F

    from stratagem.strategies.parameter_server import (
        ClusterCoordinator,
        InProcessCluster,
        ParameterServerStrategy,
    )

    cert, key = self_signed
    with InProcessCluster(num_workers=1, num_ps=1, certificate=str(cert), private_key=str(key)) as cluster:
        strategy = ParameterServerStrategy(cluster)
        assert strategy.explain().details["tls"] is True
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 2)
        model, optimizer = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.5))
        coordinator = ClusterCoordinator(strategy)
        x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))

        def step():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        losses = coordinator.fetch([coordinator.schedule(step) for _ in range(10)])
        assert losses[-1] < losses[0]
        strategy.shutdown()


def _raw_call(address: str, method: str, pieces) -> grpc.RpcError:
    """Streams ``pieces`` to ``method`` with the right token, as a hostile client holding it would; returns the error."""
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 8 << 20)])
    try:
        stub = channel.stream_stream(f"/stratagem.ParameterServer/{method}")
        with pytest.raises(grpc.RpcError) as info:
            list(stub(iter(pieces), timeout=20, metadata=((transport.TOKEN_KEY, "right"),)))
        return info.value
    finally:
        channel.close()


def _header_only(op: str, meta_json: bytes, entries: list) -> bytes:
    header = b'{"op": "%s", "meta": %s, "tensors": %s}' % (op.encode(), meta_json, json.dumps(entries).encode())
    header += b" " * (-(8 + len(header)) % 8)
    return struct.pack(">4sI", b"SGW1", len(header)) + header


@pytest.mark.timeout(60)
def test_a_parameter_server_refuses_oversized_and_deeply_nested_requests_early():
    from stratagem.strategies.parameter_server.server import SERVICE as PS_SERVICE
    from stratagem.strategies.parameter_server.server import ParameterServer

    ps = ParameterServer(security=Security(token="right"), task="ps:0")
    try:
        # Random bytes: refused on the first piece, the other 49 never read (the server used to join them all).
        error = _raw_call(ps.address, "Ping", (os.urandom(2 << 20) for _ in range(50)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith(
            "Malformed parameter-server message: wrong magic"
        )
        # A well-formed header that declares 300 MiB of tensors to a method that takes none.
        error = _raw_call(
            ps.address, "Ping", [_header_only("ping", b"null", [["x", "uint8", [300 << 20], 0]]), os.urandom(2 << 20)]
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tensors larger than this method takes. Received: 314572800 bytes" in error.details()
        # A header nested past the JSON parser's recursion limit, to a method that takes large headers.
        error = _raw_call(ps.address, "Create", [_header_only("create", b"[" * 100_000 + b"]" * 100_000, [])])
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert "header nests deeper than" in error.details()
        # A checkpoint larger than the shards this server holds (none yet).
        error = _raw_call(ps.address, "Load", [_header_only("load", b"{}", [["w", "float32", [4 << 20], 0]])])
        assert (
            error.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "tensors larger than this method takes" in error.details()
        )
        client = Client(ps.address, PS_SERVICE, security=Security(token="right"), task="ps:0")
        assert client.call("Ping", "ping", timeout=10)[1]["task"] == "ps:0"  # still serving
        client.close()
    finally:
        ps.stop()
