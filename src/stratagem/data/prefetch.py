"""Input copies to a GPU on a side stream, so the next batch travels while the current step computes.

A copy from pinned host memory issued on the compute stream waits behind the kernels queued there;
issued on a stream of its own (one per GPU, the "input stream") it runs on the copy engine alongside
them. Two things then make it safe, both documented CUDA-semantics rules of torch:

* the compute stream waits for the input stream (`Stream.wait_stream`, an event wait enqueued at
  that point), so the kernels queued after it read the batch only once the copy has landed, while
  the kernels queued before it are not held back;
* the copied tensor, allocated on the input stream and used on the compute stream, is marked with
  `Tensor.record_stream(compute)`, so the caching allocator does not hand its memory out again
  before the compute stream is done with it.

A pageable source is copied as before, on the compute stream (a copy from pageable memory cannot
overlap anything). `DistributedDataset` distributes the next batch before it yields the current one
when a replica is on a GPU, as ``tf.data``'s ``prefetch(1)`` and a ``DataLoader`` with
``pin_memory=True`` users expect.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_STREAMS: dict[torch.device, Any] = {}
_LOCK = threading.Lock()


def input_stream(device: torch.device) -> Any:
    """The side stream input copies to `device` run on (made once per GPU)."""
    with _LOCK:
        stream = _STREAMS.get(device)
        if stream is None:
            stream = _STREAMS[device] = torch.cuda.Stream(device)
        return stream


def copy_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; from pinned memory to a GPU through the input stream (see the module docstring)."""
    if device.type != "cuda" or not tensor.is_pinned():
        return tensor.to(device, non_blocking=tensor.is_pinned())
    side = input_stream(device)
    compute = torch.cuda.current_stream(device)
    with torch.cuda.stream(side):
        moved = tensor.to(device, non_blocking=True)
    compute.wait_stream(side)  # kernels queued from here on read the batch after the copy lands
    moved.record_stream(compute)  # its memory is not reused before the compute stream is done with it
    return moved
