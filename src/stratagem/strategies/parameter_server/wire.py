"""The wire format of the parameter-server protocol: a JSON header and raw tensor bytes, never pickle.

One message is::

    b"SGW1" | header length (uint32, big endian) | header (UTF-8 JSON) | payload

The header is ``{"op": str, "meta": <JSON>, "tensors": [[name, dtype, shape, offset], ...]}``;
each tensor's bytes sit in the payload at ``offset`` (a multiple of 8, so every element is
aligned), ``numel * itemsize`` long, in the sender's native byte order (both ends must share it; every
platform torch trains on is little-endian). A message is cut into chunks of ``CHUNK_BYTES`` for
gRPC streaming (``encode_chunks``) and put back together by ``join_chunks``.

Many tensors can travel as one: a ``Flat`` of tensors of one dtype is sent as one 1-D tensor
(their elements one after another) and received straight into its parts, so a message of 500
small shards costs a header entry and a few copies, not 500 of each.

Decoding checks everything before it builds a tensor: the magic, the lengths, that the header is
a JSON object of the expected form, that each dtype is one of ``DTYPES``, each shape a list of
non-negative integers, and that every tensor lies inside the payload. A ``bool`` tensor must
hold only bytes 0 and 1. Anything else raises ``WireFormatError``. (``header`` holds the header's
constants and its checks.)

    >>> message = encode("pull", {"step": 3}, {"w": torch.ones(2, 3)})
    >>> op, meta, tensors = decode(message)
    >>> op, meta, tensors["w"].shape
    ('pull', {'step': 3}, torch.Size([2, 3]))
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy
import torch

from stratagem.errors import WireFormatError
from stratagem.strategies.parameter_server.flat import SMALL_PART_BYTES, Flat, Staging
from stratagem.strategies.parameter_server.header import (
    ALIGN,
    DTYPES,
    ITEMSIZE,
    MAGIC,
    MAX_DEPTH,
    MAX_HEADER_BYTES,
    PREFIX,
    TOO_LARGE,
    aligned,
    check_entry,
    malformed,
    parse_header,
    payload_extent,
    read_header,
)

__all__ = [
    "ALIGN",
    "CHUNK_BYTES",
    "DTYPES",
    "MAGIC",
    "MAX_DEPTH",
    "MAX_HEADER_BYTES",
    "SMALL_PART_BYTES",
    "Flat",
    "Staging",
    "decode",
    "decode_into",
    "encode",
    "encode_chunks",
    "join_chunks",
    "join_piece",
    "payload_extent",
    "piece_bounds",
    "read_message",
    "segments",
    "stream_chunks",
]

CHUNK_BYTES = 2 << 20

_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _bytes_view(tensor: torch.Tensor) -> numpy.ndarray:
    """The bytes of a tensor's memory as a flat, writable uint8 array (a copy only for a non-contiguous
    or non-CPU tensor). Numpy calls are far cheaper than torch calls per tensor, which matters for
    messages of many small tensors; numpy has no bfloat16, so that one goes through a torch view."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.reshape(-1).view(torch.uint8).numpy()
    return tensor.numpy().reshape(-1).view(numpy.uint8)


def encode_chunks(
    op: str, meta: Any = None, tensors: Mapping[str, torch.Tensor | Flat] | None = None, chunk_bytes: int = CHUNK_BYTES
) -> list[bytes]:
    """One message (operation name, JSON metadata, named tensors) cut into pieces of at most ``chunk_bytes``.

    Each piece is built straight from the tensors' memory with one copy (gRPC needs ``bytes``),
    so a message is never assembled whole on the sending side; small tensors share pieces.
    """
    return list(stream_chunks(op, meta, tensors, chunk_bytes))


def stream_chunks(
    op: str, meta: Any = None, tensors: Mapping[str, torch.Tensor | Flat] | None = None, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[bytes]:
    """``encode_chunks`` as an iterator: everything is checked now, and each piece is copied out of the
    tensors only when it is asked for, so gRPC sends one piece while the next is made. The tensors
    must not change until the last piece is taken."""
    return _pieces(segments(op, meta, tensors), chunk_bytes)


def segments(
    op: str, meta: Any = None, tensors: Mapping[str, torch.Tensor | Flat] | None = None
) -> list[memoryview | bytes | numpy.ndarray]:
    """The parts a message is made of, in order: its prefix and header, then views of the tensors' bytes
    and padding (nothing copied yet). Two messages with the same operation, metadata, names, dtypes
    and shapes have parts of the same lengths, so a piece (``piece_bounds``) can be cut from either."""
    tensors = tensors or {}
    entries = []
    parts: list[memoryview | bytes | numpy.ndarray] = []
    offset = 0
    for name, tensor in tensors.items():
        if not isinstance(tensor, (torch.Tensor, Flat)):
            raise WireFormatError(
                f"Only tensors travel as tensors. Received: {name}={type(tensor).__name__}. "
                "Pass torch.Tensor values, or put plain values in meta."
            )
        if tensor.dtype not in _NAMES:
            raise WireFormatError(
                f"This dtype cannot travel. Received: {name} of dtype {tensor.dtype}. "
                f"Convert it to one of {sorted(DTYPES)}."
            )
        nbytes = tensor.nbytes
        if isinstance(tensor, Flat):
            entries.append([name, _NAMES[tensor.dtype], [tensor.numel], offset])
            parts.extend(_bytes_view(block) for block in tensor.gather())
        else:
            entries.append([name, _NAMES[tensor.dtype], list(tensor.shape), offset])
            if nbytes:
                parts.append(_bytes_view(tensor))
        padding = aligned(nbytes) - nbytes
        if padding:
            parts.append(bytes(padding))
        offset += nbytes + padding
    try:
        header = json.dumps({"op": op, "meta": meta, "tensors": entries}, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise WireFormatError(
            f"The metadata is not plain JSON. Received: meta={meta!r:.200} ({exc}). "
            "Use numbers, strings, booleans, None, lists and dicts with string keys."
        ) from exc
    # Spaces after the JSON put the payload at a multiple of ALIGN, so tensors decode in place, aligned.
    header += b" " * (aligned(PREFIX.size + len(header)) - PREFIX.size - len(header))
    parts.insert(0, PREFIX.pack(MAGIC, len(header)) + header)
    return parts


def piece_bounds(sizes: Iterable[int], chunk_bytes: int = CHUNK_BYTES) -> list[list[tuple[int, int, int]]]:
    """How parts of these byte lengths are cut into pieces of at most ``chunk_bytes``: for each piece,
    ``(part index, start, stop)`` of the bytes it takes, in order."""
    pieces: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    room = chunk_bytes
    for index, size in enumerate(sizes):
        start = 0
        while start < size:
            take = min(room, size - start)
            current.append((index, start, start + take))
            start += take
            room -= take
            if room == 0:
                pieces.append(current)
                current, room = [], chunk_bytes
    if current:  # the header is never empty, so every message has at least one piece
        pieces.append(current)
    return pieces


def join_piece(parts: list[memoryview | bytes | numpy.ndarray], bounds: list[tuple[int, int, int]]) -> bytes:
    """One piece (``piece_bounds``) copied out of the message's parts: the one copy gRPC needs."""
    # A numpy array is a buffer; numpy's stubs declare it only for Python 3.12 and later (__buffer__).
    return b"".join([memoryview(parts[index])[start:stop] for index, start, stop in bounds])  # type: ignore[arg-type]


def _pieces(parts: list[memoryview | bytes | numpy.ndarray], chunk_bytes: int) -> Iterator[bytes]:
    for bounds in piece_bounds([memoryview(part).nbytes for part in parts], chunk_bytes):  # type: ignore[arg-type]
        yield join_piece(parts, bounds)


def encode(op: str, meta: Any = None, tensors: Mapping[str, torch.Tensor | Flat] | None = None) -> bytearray:
    """One whole message (``encode_chunks`` joined)."""
    return join_chunks(encode_chunks(op, meta, tensors))


def _check_bool(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype == torch.bool and bool((tensor.view(torch.uint8) > 1).any()):
        raise malformed("a bool tensor holds bytes other than 0 and 1", f"name={name!r}")


def decode(message: bytes | bytearray | memoryview) -> tuple[str, Any, dict[str, torch.Tensor]]:
    """``(op, meta, tensors)`` from one message; the tensors share the message's memory.

    Raises ``WireFormatError`` for anything that is not a well-formed message.
    """
    view = memoryview(message)
    header, start = parse_header(view)
    return _decode_parsed(message, view, header, start)


def _decode_parsed(
    message: bytes | bytearray | memoryview, view: memoryview, header: dict[str, Any], start: int
) -> tuple[str, Any, dict[str, torch.Tensor]]:
    payload_len = len(view) - start
    # The tensors are views of the message itself: a writable bytearray (join_chunks gives one)
    # is used in place; anything else is copied once.
    buffer = message if isinstance(message, bytearray) else bytearray(view)
    tensors: dict[str, torch.Tensor] = {}
    for entry in header["tensors"]:
        name, dtype, shape, offset, nbytes = check_entry(entry, payload_len)
        if name in tensors:
            raise malformed("a tensor name appears twice", f"name={name!r}")
        if nbytes == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        numel = nbytes // ITEMSIZE[dtype]
        tensor = torch.frombuffer(buffer, dtype=dtype, count=numel, offset=start + offset).reshape(shape)
        _check_bool(name, tensor)
        tensors[name] = tensor
    return header["op"], header["meta"], tensors


def decode_into(
    pieces: Iterable[bytes],
    destinations: Mapping[str, torch.Tensor | Flat],
    *,
    exact: bool = True,
    progress: Callable[[dict[str, Any], int], None] | None = None,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> tuple[str, Any, list[str]]:
    """Streams a message's tensors straight into ``destinations`` as its pieces arrive.

    Each destination (by name) must be a contiguous CPU tensor of the same dtype and shape, or a
    ``Flat`` of the same dtype and element count; the message must carry exactly those tensors
    (``exact``) or some of them. One copy, from the received bytes into the tensors, and the
    message is never held whole: the fast path of pulls and pushes. Returns ``(op, meta, names of
    the tensors written)``. ``progress(header, n)``, when given, is called each time the first ``n``
    bytes of the payload have been written (the header is checked by then). A header longer than
    ``max_header_bytes`` is refused before it is read whole.
    """
    pieces = iter(pieces)
    head, header, start = read_header(pieces, max_header_bytes)
    targets = []  # (payload offset, bytes, flat uint8 view to fill)
    names = []
    gathered = []  # Flat blocks received whole, to scatter to their parts at the end
    for entry in header["tensors"]:
        name, dtype, shape, offset, nbytes = check_entry(entry, None)
        dest = destinations.get(name)
        if isinstance(dest, Flat):
            if dest.dtype != dtype or [dest.numel] != shape:
                raise malformed(
                    "tensors do not match the destinations",
                    f"{name} {dtype} {shape}, destination {dest.dtype} [{dest.numel}] (flat)",
                )
            for block, parts in dest.blocks():
                targets.append((offset, block.nbytes, _bytes_view(block)))
                offset += block.nbytes
                if parts:
                    gathered.append((block, parts))
        elif dest is None or dest.dtype != dtype or list(dest.shape) != shape:
            raise malformed(
                "tensors do not match the destinations",
                f"{name} {dtype} {shape}, destination {None if dest is None else (dest.dtype, list(dest.shape))}",
            )
        elif nbytes:
            targets.append((offset, nbytes, _bytes_view(dest)))
        names.append(name)
    if (exact and len(names) != len(destinations)) or len(set(names)) != len(names):
        raise malformed(
            "tensors do not match the destinations",
            f"{len(names)} tensors ({len(set(names))} names) for {len(destinations)} destinations",
        )
    targets.sort(key=lambda t: t[0])
    expected = max((aligned(off + n) for off, n, _ in targets), default=0)
    position, first = 0, 0  # payload offset of the next byte; first target not yet filled

    def take(block: memoryview) -> None:
        nonlocal position, first
        end = position + len(block)
        if end > expected:
            raise malformed("payload longer than its tensors", f"more than {expected} bytes")
        index = first
        while index < len(targets) and targets[index][0] < end:
            off, nbytes, flat = targets[index]
            lo, hi = max(off, position), min(off + nbytes, end)
            if lo < hi:
                flat[lo - off : hi - off] = numpy.frombuffer(block, numpy.uint8, hi - lo, lo - position)
            if off + nbytes <= end:
                first = index + 1
            index += 1
        position = end

    take(memoryview(head)[start:])
    if progress is not None:
        progress(header, position)
    for piece in pieces:
        take(memoryview(piece))
        if progress is not None:
            progress(header, position)
    if position != expected:
        raise malformed("payload shorter than its tensors", f"{position} of {expected} bytes")
    Flat.scatter(gathered)
    for name in names:
        dest = destinations[name]
        if dest.dtype == torch.bool:  # once per Flat, not once per part (500 parts: 0.2 ms a pull)
            for tensor in dest.parts if isinstance(dest, Flat) else (dest,):
                _check_bool(name, tensor)
    return header["op"], header["meta"], names


def read_message(
    pieces: Iterable[bytes], *, max_header_bytes: int = MAX_HEADER_BYTES, max_payload_bytes: int | None = None
) -> tuple[str, Any, dict[str, torch.Tensor]]:
    """``decode(join_chunks(pieces))`` that checks before it buffers: the magic and the header's length on the
    first bytes, then the header, then the payload's length as the header declares it against
    ``max_payload_bytes``; only then is the payload taken, into one buffer of that length, and a message
    longer or shorter than it declares is refused. So a peer that sends more than a method takes costs
    the receiver a piece or two, not the whole stream."""
    pieces = iter(pieces)
    head, header, start = read_header(pieces, max_header_bytes)
    extent = payload_extent(header)
    if max_payload_bytes is not None and extent > max_payload_bytes:
        raise malformed(
            "tensors larger than this method takes",
            f"{extent} bytes of tensors declared, at most {max_payload_bytes}",
            TOO_LARGE,
        )
    message = bytearray(start + extent)
    filled = min(len(head), len(message))
    message[:filled] = memoryview(head)[:filled]
    if len(head) > len(message):
        raise malformed("payload longer than its tensors", f"more than {extent} bytes")
    for piece in pieces:
        end = filled + len(piece)
        if end > len(message):
            raise malformed("payload longer than its tensors", f"more than {extent} bytes")
        message[filled:end] = piece
        filled = end
    if filled != len(message):
        raise malformed("payload shorter than its tensors", f"{filled - start} of {extent} bytes")
    return _decode_parsed(message, memoryview(message), header, start)


def join_chunks(pieces: Iterable[bytes], max_bytes: int | None = None) -> bytearray:
    """The message the pieces of ``encode_chunks`` came from (one copy); refuses to grow past ``max_bytes``."""
    parts = []
    total = 0
    for piece in pieces:
        total += len(piece)
        if max_bytes is not None and total > max_bytes:
            raise malformed("message larger than allowed", f"more than {max_bytes} bytes")
        parts.append(piece)
    return bytearray().join(parts)
