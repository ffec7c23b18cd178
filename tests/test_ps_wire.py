"""Wire format of the parameter-server protocol: round trips over dtypes and shapes, and refusal of malformed input."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stratagem.errors import WireFormatError
from stratagem.strategies.parameter_server import wire

DTYPES = sorted(wire.DTYPES)


@st.composite
def tensors(draw):
    dtype = wire.DTYPES[draw(st.sampled_from(DTYPES))]
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=4))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(st.text(min_size=1, max_size=8), tensors(), max_size=5),
    st.recursive(
        st.none() | st.booleans() | st.integers(-(10**9), 10**9) | st.text(max_size=10),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
        max_leaves=8,
    ),
)
def test_round_trip_keeps_names_dtypes_shapes_and_bytes(named, meta):
    op, got_meta, got = wire.decode(wire.encode("push", meta, named))
    assert op == "push" and got_meta == meta and list(got) == list(named)
    for name, tensor in named.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(
            got[name].reshape(-1).view(torch.uint8) if tensor.numel() else got[name],
            tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor,
        )


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_are_refused_cleanly(data):
    with pytest.raises(WireFormatError, match="Malformed parameter-server message"):
        wire.decode(data)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 200))
def test_truncated_messages_are_refused(cut):
    message = bytes(wire.encode("pull", {"a": 1}, {"w": torch.arange(20, dtype=torch.float32)}))
    cut = min(cut, len(message) - 1)
    with pytest.raises(WireFormatError, match="Malformed"):
        wire.decode(message[:cut])


def test_chunks_join_back_and_large_tensors_are_cut():
    big = torch.randn(2 * wire.CHUNK_BYTES // 4 + 17)  # two chunks and a bit
    pieces = wire.encode_chunks("push", None, {"big": big})
    assert len(pieces) == 3 and all(len(p) <= wire.CHUNK_BYTES for p in pieces)
    small = wire.encode_chunks("pull", None, {f"t{i}": torch.ones(1024) for i in range(100)})
    assert len(small) == 1  # 100 tensors of 4 KiB share one piece
    assert torch.equal(wire.decode(wire.join_chunks(pieces))[2]["big"], big)
    with pytest.raises(WireFormatError, match="larger than allowed"):
        wire.join_chunks(pieces, max_bytes=wire.CHUNK_BYTES)


def _forged(header: object, payload: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)  # a well-aligned payload, so the check under test is reached
    return struct.pack(">4sI", b"SGW1", len(text)) + text + payload


@pytest.mark.parametrize(
    "header, payload, match",
    [
        ({"op": "x", "meta": None, "tensors": [["w", "pickle", [1], 0]]}, b"\0" * 8, "unknown dtype"),
        ({"op": "x", "meta": None, "tensors": [["w", "float32", [-1], 0]]}, b"", "shape is not"),
        ({"op": "x", "meta": None, "tensors": [["w", "float32", [4], 0]]}, b"\0" * 8, "outside the payload"),
        ({"op": "x", "meta": None, "tensors": [["w", "float32", [1], 3]]}, b"\0" * 16, "outside the payload"),
        ({"op": "x", "meta": None, "tensors": [["w", "bool", [2], 0]]}, b"\x01\x07" + b"\0" * 6, "bool tensor"),
        ({"op": "x", "meta": None, "tensors": [["w", "int8", [1], 0], ["w", "int8", [1], 8]]}, b"\0" * 16, "twice"),
        ({"op": "x", "tensors": []}, b"", r"not \{op, meta, tensors\}"),
        (["op"], b"", r"not \{op, meta, tensors\}"),
        ({"op": "x", "meta": None, "tensors": ["w"]}, b"", "not \\[name, dtype, shape, offset\\]"),
    ],
)
def test_forged_headers_are_refused(header, payload, match):
    with pytest.raises(WireFormatError, match=match):
        wire.decode(_forged(header, payload))


def test_bad_magic_and_lengths_are_refused():
    with pytest.raises(WireFormatError, match="wrong magic"):
        wire.decode(b"PKL1" + b"\0" * 12)
    with pytest.raises(WireFormatError, match="header length out of range"):
        wire.decode(struct.pack(">4sI", b"SGW1", 10**6) + b"{}")
    with pytest.raises(WireFormatError, match="header is not JSON"):
        wire.decode(struct.pack(">4sI", b"SGW1", 8) + b"\xff\xfe{     ")
    with pytest.raises(WireFormatError, match="payload does not start at a multiple of 8"):
        wire.decode(struct.pack(">4sI", b"SGW1", 2) + b"{}")


def test_encode_refuses_what_cannot_travel():
    with pytest.raises(WireFormatError, match="Only tensors travel"):
        wire.encode("x", None, {"w": [1.0]})
    with pytest.raises(WireFormatError, match="not plain JSON"):
        wire.encode("x", {"f": object()})
    with pytest.raises(WireFormatError, match="not plain JSON"):
        wire.encode("x", {"f": float("nan")})


@settings(max_examples=30, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=8), tensors(), min_size=1, max_size=5), st.integers(8, 64))
def test_decode_into_streams_tensors_into_destinations(named, chunk_bytes):
    pieces = wire.encode_chunks("values", {"v": 1}, named, chunk_bytes=chunk_bytes)  # tiny pieces: tensors span them
    destinations = {name: torch.empty_like(t) for name, t in named.items()}
    assert wire.decode_into(pieces, destinations) == ("values", {"v": 1}, list(named))
    for name, tensor in named.items():
        assert torch.equal(
            destinations[name].reshape(-1).view(torch.uint8) if tensor.numel() else destinations[name],
            tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor,
        )


def test_decode_into_refuses_mismatches_and_short_or_long_payloads():
    named = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    pieces = wire.encode_chunks("values", None, named, chunk_bytes=16)
    with pytest.raises(WireFormatError, match="tensors do not match the destinations"):
        wire.decode_into(pieces, {"w": torch.empty(2, 3), "b": torch.empty(4)})
    with pytest.raises(WireFormatError, match="tensors do not match the destinations"):
        wire.decode_into(pieces, {"w": torch.empty(2, 3), "b": torch.empty(3), "extra": torch.empty(1)})
    with pytest.raises(WireFormatError, match="payload shorter than its tensors"):
        wire.decode_into(pieces[:-1], {"w": torch.empty(2, 3), "b": torch.empty(3)})
    with pytest.raises(WireFormatError, match="payload longer than its tensors"):
        wire.decode_into([*pieces, b"\0" * 8], {"w": torch.empty(2, 3), "b": torch.empty(3)})
    with pytest.raises(WireFormatError, match="wrong magic"):
        wire.decode_into([b"PKL1\0\0\0\0"], {})


def _counted(pieces):
    """The pieces, and a list that grows by one for each piece taken."""
    taken = []

    def stream():
        for piece in pieces:
            taken.append(1)
            yield piece

    return stream(), taken


def test_read_message_refuses_bad_bytes_on_the_first_piece_without_reading_on():
    stream, taken = _counted([os.urandom(1 << 20) for _ in range(50)])
    with pytest.raises(WireFormatError, match="wrong magic bytes"):
        wire.read_message(stream, max_payload_bytes=0)
    assert len(taken) == 1


def test_read_message_refuses_declared_tensors_larger_than_the_method_takes_before_buffering():
    pieces = wire.encode_chunks("ping", None, {"x": torch.zeros(3 << 20, dtype=torch.uint8)}, chunk_bytes=1 << 20)
    stream, taken = _counted(pieces)
    with pytest.raises(
        WireFormatError,
        match="tensors larger than this method takes. Received: 3145728 bytes of tensors declared, at most 1024",
    ):
        wire.read_message(stream, max_payload_bytes=1024)
    assert len(taken) == 1


def test_read_message_refuses_a_long_header_on_its_first_bytes():
    message = bytes(wire.encode("x", {"pad": "a" * 5000}))
    stream, taken = _counted([message[:8], message[8:]])
    with pytest.raises(
        WireFormatError, match="header longer than this method takes. Received: header_len=50.., at most 4096"
    ):
        wire.read_message(stream, max_header_bytes=4096)
    assert len(taken) == 1


def test_read_message_refuses_more_or_fewer_bytes_than_declared():
    pieces = wire.encode_chunks("v", {"a": 1}, {"w": torch.arange(6.0)})
    assert wire.read_message(pieces)[1] == {"a": 1}
    with pytest.raises(WireFormatError, match="payload longer than its tensors"):
        wire.read_message([*pieces, b"\0" * 8])
    with pytest.raises(WireFormatError, match="payload shorter than its tensors"):
        wire.read_message([bytes(wire.encode("v", None, {"w": torch.arange(6.0)}))[:-8]])


@pytest.mark.parametrize("depth", [wire.MAX_DEPTH + 1, 100_000])
def test_a_deeply_nested_header_is_malformed_not_a_recursion_error(depth):
    header = b'{"op": "x", "meta": ' + b"[" * depth + b"]" * depth + b', "tensors": []}'
    header += b" " * (-(8 + len(header)) % 8)
    message = b"SGW1" + struct.pack(">I", len(header)) + header
    with pytest.raises(WireFormatError, match=f"header nests deeper than {wire.MAX_DEPTH} levels"):
        wire.read_message([message])
    with pytest.raises(WireFormatError, match="nests deeper"):
        wire.decode(message)
