"""Many tensors of one dtype that travel as one (``Flat``), and the buffer a sender keeps for them (``Staging``).

Part of the wire format (``wire`` re-exports both): a ``Flat`` is sent as one 1-D tensor, its parts'
elements one after another, and received straight into its parts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from stratagem.errors import WireFormatError

SMALL_PART_BYTES = 64 << 10
"""Parts smaller than this that do not lie next to each other in memory are gathered with one torch
call (and scattered back with one), instead of costing Python work each."""


class Flat:
    """Tensors of one dtype that travel as one 1-D tensor: every element of ``parts[0]``, then ``parts[1]``...

    Sending (``gather``) reads large parts where they lie and copies runs of small ones together
    with one ``torch`` call. Receiving (``decode_into``) writes each part in place: parts that
    follow each other in one storage (views of one buffer) take one block of the message, runs of
    small scattered parts are received together and scattered with one call. Destinations must be
    contiguous CPU tensors; a ``Flat`` of persistent tensors (a model's parameters) can be kept and
    reused, which saves working out its blocks again. Not for use by two threads at once.

        >>> flat = Flat([torch.zeros(2, 2), torch.ones(3)])
        >>> flat.numel, wire.decode(wire.encode("v", None, {"all": flat}))[2]["all"].tolist()
        (7, [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    """

    def __init__(self, parts: Iterable[torch.Tensor], staging: Staging | None = None) -> None:
        self.parts = list(parts)
        self._staging = staging
        if not self.parts:
            raise WireFormatError("A Flat needs at least one tensor. Received: none. Leave it out of the message.")
        self.dtype = self.parts[0].dtype
        dtypes = {p.dtype for p in self.parts}
        if len(dtypes) > 1:
            raise WireFormatError(
                f"The parts of a Flat must share one dtype. Received: "
                f"{sorted(str(d) for d in dtypes)}. Use one Flat per dtype."
            )
        self.numel = sum(map(torch.Tensor.numel, self.parts))
        self._blocks: list[tuple[torch.Tensor, list[torch.Tensor] | None]] | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.parts[0].element_size()

    def gather(self) -> list[torch.Tensor]:
        """The 1-D blocks to send, in order: large parts as they are, runs of small ones copied together
        (into the ``staging`` buffer when there is one, which saves paging in fresh memory each time)."""
        return (self._staging or Staging()).gather(self.parts)

    def blocks(self) -> list[tuple[torch.Tensor, list[torch.Tensor] | None]]:
        """Where received bytes go, in order: ``(block, None)`` is memory of the parts themselves, written
        in place; ``(block, parts)`` is a buffer for small scattered parts, copied out by ``scatter``."""
        if self._blocks is None:
            self._blocks = self._find_blocks()
        return self._blocks

    def _find_blocks(self) -> list[tuple[torch.Tensor, list[torch.Tensor] | None]]:
        runs: list[list[torch.Tensor]] = []  # parts that follow each other in one storage
        end = None
        for part in self.parts:
            if part.requires_grad or part.device.type != "cpu" or not part.is_contiguous():
                raise WireFormatError(
                    f"Received tensors are written into contiguous CPU tensors that do not require grad. Received: "
                    f"a destination on {part.device} (contiguous: {part.is_contiguous()}, requires_grad: "
                    f"{part.requires_grad}). Pass detached, contiguous CPU tensors, or decode then copy."
                )
            if part.numel() == 0:
                continue
            storage = part.untyped_storage().data_ptr()
            if runs and (storage, part.storage_offset()) == end:
                runs[-1].append(part)
            else:
                runs.append([part])
            end = (storage, part.storage_offset() + part.numel())
        blocks: list[tuple[torch.Tensor, list[torch.Tensor] | None]] = []
        scattered: list[torch.Tensor] = []
        for run in runs:
            if len(run) == 1 and run[0].nbytes < SMALL_PART_BYTES:
                scattered.append(run[0])
                continue
            if scattered:
                blocks.append((torch.empty(sum(p.numel() for p in scattered), dtype=self.dtype), scattered))
                scattered = []
            first = run[0]
            # torch's stubs type storage_offset() as int | SymInt, which no overload of set_ takes.
            block = torch.empty(0, dtype=self.dtype).set_(
                first.untyped_storage(),
                first.storage_offset(),  # type: ignore[call-overload]
                (sum(p.numel() for p in run),),
            )
            blocks.append((block, None))
        if scattered:
            blocks.append((torch.empty(sum(p.numel() for p in scattered), dtype=self.dtype), scattered))
        return blocks

    def read_from(self, source: torch.Tensor) -> None:
        """Copies a 1-D tensor of ``numel`` elements (the parts one after another) into the parts: a block of
        neighbouring parts with one copy (none when they are that memory), small scattered parts with one
        call for all."""
        targets, sources = [], []
        offset = 0
        for block, parts in self.blocks():
            piece = source[offset : offset + block.numel()]
            offset += block.numel()
            if parts is None:
                if block.data_ptr() != piece.data_ptr():  # the parts may live in the source itself
                    block.copy_(piece)
            else:
                targets.extend(parts)
                sources.extend(torch._C._nn.unflatten_dense_tensors(piece, parts))
        if targets:
            torch._foreach_copy_(targets, sources)

    @staticmethod
    def scatter(blocks: list[tuple[torch.Tensor, list[torch.Tensor]]]) -> None:
        """Copies received buffers of small scattered parts out to their parts (one call for all)."""
        sources, targets = [], []
        for block, parts in blocks:
            sources.extend(torch._C._nn.unflatten_dense_tensors(block, parts))
            targets.extend(parts)
        if targets:
            torch._foreach_copy_(targets, sources)


class Staging:
    """A buffer kept between messages for gathering the small parts of ``Flat``s of the same shapes.

    A fresh buffer per message costs a page fault per 4 KiB on first touch, which on a virtual
    machine can take longer than the copy itself; a worker pushes gradients of the same shapes at
    every step, so it keeps one of these per bucket. Not for use by two threads at once.
    """

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._small: list[int] = []
        self._views: list[torch.Tensor] = []
        self._plan: list[tuple[int, int, int]] = []  # (part index or -1, start, stop) in the buffer

    def gather(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """``Flat.gather`` through the kept buffer."""
        key = (parts[0].dtype, parts[0].device, *(p.shape for p in parts))
        if key != self._key:
            self._prepare(parts, key)
        if self._small:
            torch._foreach_copy_(self._views, [parts[i] for i in self._small])
        return [parts[i].reshape(-1) if i >= 0 else self._buffer[start:stop] for i, start, stop in self._plan]

    def _prepare(self, parts: list[torch.Tensor], key: tuple[Any, ...]) -> None:
        """The buffer (room for the small parts only) and the plan: large parts sent as they are, each run
        of consecutive small parts as one slice of the buffer."""
        self._small = [i for i, p in enumerate(parts) if p.nbytes < SMALL_PART_BYTES]
        small = [parts[i] for i in self._small]
        self._buffer = torch.empty(sum(p.numel() for p in small), dtype=parts[0].dtype, device=parts[0].device)
        self._views = list(torch._C._nn.unflatten_dense_tensors(self._buffer, small)) if small else []
        self._plan = []
        start = 0
        for index, part in enumerate(parts):
            if part.nbytes >= SMALL_PART_BYTES:
                self._plan.append((index, 0, 0))
                continue
            stop = start + part.numel()
            if self._plan and self._plan[-1][0] < 0 and self._plan[-1][2] == start:
                self._plan[-1] = (-1, self._plan[-1][1], stop)
            else:
                self._plan.append((-1, start, stop))
            start = stop
        self._key = key
