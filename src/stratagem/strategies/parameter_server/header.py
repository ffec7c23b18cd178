"""The header of a parameter-server message, and every check a received header passes.

A message starts with ``MAGIC`` and the header's length (``PREFIX``), then the header: UTF-8 JSON
of the form ``{"op": str, "meta": <JSON>, "tensors": [[name, dtype, shape, offset], ...]}``, padded
with spaces so that the payload starts at a multiple of ``ALIGN``. Before a tensor is built from a
peer's bytes, the header is checked here: the magic, its length (at most ``MAX_HEADER_BYTES``, or
what the method takes), that it is JSON nested at most ``MAX_DEPTH`` deep and of that form, and for
each tensor entry that its dtype is one of ``DTYPES``, its shape a list of non-negative integers
and its bytes aligned and inside the payload. Anything else raises ``WireFormatError`` (built by
``malformed``). ``wire`` encodes messages and decodes their payloads.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any

import torch

from stratagem.errors import WireFormatError

MAGIC = b"SGW1"
PREFIX = struct.Struct(">4sI")
MAX_HEADER_BYTES = 64 << 20
MAX_DEPTH = 64
"""How deeply a header's JSON may nest: far more than any message needs, far less than Python's recursion limit."""
ALIGN = 8

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
ITEMSIZE = {dtype: torch.empty(0, dtype=dtype).element_size() for dtype in DTYPES.values()}


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


# The fix named when a peer sends a method more than it takes.
TOO_LARGE = (
    "A stratagem task never sends this method more; check that only this job's tasks hold its cluster "
    "token, and that both ends run the same model"
)


def malformed(what: str, received: str, fix: str | None = None) -> WireFormatError:
    """The error for a message that is not well formed: ``what`` is wrong, what was ``received``, and the ``fix``."""
    return WireFormatError(
        f"Malformed parameter-server message: {what}. Received: {received}. "
        f"{fix or 'Send messages built by stratagem.strategies.parameter_server.wire.encode_chunks'}."
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_header(view: memoryview) -> tuple[dict[str, Any], int]:
    """The header of a message that starts ``view`` (the payload may be partly there) and the payload's start."""
    if len(view) < PREFIX.size:
        raise malformed("shorter than its fixed prefix", f"{len(view)} bytes")
    magic, header_len = PREFIX.unpack(view[: PREFIX.size])
    if magic != MAGIC:
        raise malformed("wrong magic bytes", f"{bytes(magic)!r}, expected {MAGIC!r}")
    if header_len > MAX_HEADER_BYTES or PREFIX.size + header_len > len(view):
        raise malformed("header length out of range", f"header_len={header_len}, message of {len(view)} bytes")
    if (PREFIX.size + header_len) % ALIGN:
        raise malformed(f"payload does not start at a multiple of {ALIGN}", f"header_len={header_len}")
    try:
        header = json.loads(bytes(view[PREFIX.size : PREFIX.size + header_len]))
    except (UnicodeDecodeError, ValueError) as exc:
        raise malformed("header is not JSON", str(exc)) from None
    except RecursionError:
        raise malformed(f"header nests deeper than {MAX_DEPTH} levels", f"a header of {header_len} bytes") from None
    _check_depth(header, header_len)
    if (
        not isinstance(header, dict)
        or set(header) != {"op", "meta", "tensors"}
        or not isinstance(header["op"], str)
        or not isinstance(header["tensors"], list)
    ):
        raise malformed("header is not {op, meta, tensors}", f"{str(header)[:200]}")
    return header, PREFIX.size + header_len


def _check_depth(value: Any, header_len: int) -> None:
    """Refuses JSON nested deeper than ``MAX_DEPTH`` (walked without recursion), so no handler recurses past
    Python's limit on what a peer sent."""
    level = [value]
    for _ in range(MAX_DEPTH + 1):
        level = [
            child
            for node in level
            if isinstance(node, (list, dict))
            for child in (node.values() if isinstance(node, dict) else node)
        ]
        if not level:
            return
    raise malformed(f"header nests deeper than {MAX_DEPTH} levels", f"a header of {header_len} bytes")


def check_entry(entry: Any, payload_len: int | None) -> tuple[str, torch.dtype, list[int], int, int]:
    """``(name, dtype, shape, offset, byte length)`` of one tensor entry of a header, checked (against
    ``payload_len`` too, when the payload's length is known)."""
    if not (
        isinstance(entry, list)
        and len(entry) == 4
        and isinstance(entry[0], str)
        and isinstance(entry[1], str)
        and isinstance(entry[2], list)
        and _is_int(entry[3])
    ):
        raise malformed("a tensor entry is not [name, dtype, shape, offset]", f"{str(entry)[:200]}")
    name, dtype_name, shape, offset = entry
    if dtype_name not in DTYPES:
        raise malformed("unknown dtype", f"{name}: dtype={dtype_name!r}, known {sorted(DTYPES)}")
    if len(shape) > 32 or not all(_is_int(d) and 0 <= d < 2**48 for d in shape):
        raise malformed("shape is not a list of at most 32 non-negative integers", f"{name}: shape={shape!r:.200}")
    dtype = DTYPES[dtype_name]
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * ITEMSIZE[dtype]
    if offset < 0 or offset % ALIGN or (payload_len is not None and offset + nbytes > payload_len):
        raise malformed(
            "tensor bytes lie outside the payload",
            f"{name}: offset={offset}, {nbytes} bytes, payload of {payload_len} bytes",
        )
    return name, dtype, shape, offset, nbytes


def read_header(pieces: Iterator[bytes], max_header_bytes: int) -> tuple[bytes | bytearray, dict[str, Any], int]:
    """Takes pieces until the header is in; returns what was taken, the checked header and the payload's start.
    The magic and the header's length are checked on the first bytes, before more is read."""
    head: bytes | bytearray = b""
    for piece in pieces:
        if not head:
            head = piece  # used as it is when it holds the whole header, as it nearly always does (no copy)
        else:
            head = head if isinstance(head, bytearray) else bytearray(head)
            head += piece
        if len(head) >= PREFIX.size:
            magic, header_len = PREFIX.unpack_from(head)
            if magic != MAGIC:
                break  # parse_header names it
            if header_len > max_header_bytes:
                raise malformed(
                    "header longer than this method takes",
                    f"header_len={header_len}, at most {max_header_bytes} bytes",
                    TOO_LARGE,
                )
            if len(head) >= PREFIX.size + header_len:
                break
    header, start = parse_header(memoryview(head))
    return head, header, start


def payload_extent(header: dict[str, Any]) -> int:
    """The payload's length in bytes as the header declares it (each tensor's end, aligned; the last one)."""
    return max(
        (
            aligned(offset + nbytes)
            for _, _, _, offset, nbytes in (check_entry(entry, None) for entry in header["tensors"])
        ),
        default=0,
    )
