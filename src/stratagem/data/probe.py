"""One example of a global batch read by every worker, so that workers cut at the index level compare values.

A loader cut at the index level (`worker_shards.py`) hands each worker only its own examples of every global
batch: no two workers hold the same example, so the values they train on cannot be compared, and the batch
check compared only the indices the sampler drew. Those agree when every worker builds ANOTHER data set from
unseeded random numbers, or lists its files in another order, and the job trains each worker on different data
without a word (issue 38). So at the first batch of each pass and every `PROBE_EVERY` batches after it, every
worker also reads the global batch's first example itself (`dataset[indices[0]]`, in this process, outside the
loader) and hashes a few of its values (`example_digest`); the digests ride the batch check and must agree.

The read draws no random number from the job's streams and sees the same ones on every worker: torch's CPU
generator, Python's `random` and NumPy's global generator are set to one fixed state around it and restored
after it, so a data set with random augmentations reads the same values on every worker, and the job's
random streams (its shuffles, dropout) are the same with the check on or off. One read of a TensorDataset's
example costs about 80 us on the 2-vCPU machine, most of it NumPy's state saved and set, hence the spacing:
0.12% of a step of the README's first example under `stratagem launch --workers 2` (docs/multi_worker.md).

    >>> example_digest(TensorDataset(x, y), 17)      # the same int on every worker that built the same data
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch

from stratagem.values import flatten

PROBE_EVERY = 32
"""The first batch of each pass, and every this many batches after it, carry the digest of one example."""
SAMPLES_PER_LEAF = 64
"""Values of each tensor of the example hashed, evenly strided through it."""

_SEED = 0x5EED


def due(position: int) -> bool:
    """Whether the batch at `position` (0-based, in its pass) carries an example's digest."""
    return position % PROBE_EVERY == 0


@contextlib.contextmanager
def fixed_random_state() -> Iterator[None]:
    """Torch's CPU generator, Python's `random` and NumPy's global generator in one fixed state, restored after."""
    generator = torch.random.default_generator
    saved_torch = generator.get_state()
    saved_python = random.getstate()
    numpy = sys.modules.get("numpy")  # a data set that draws from NumPy imported it; otherwise it draws nothing
    saved_numpy = numpy.random.get_state() if numpy is not None else None
    try:
        generator.manual_seed(_SEED)
        random.seed(_SEED)
        if numpy is not None:
            numpy.random.seed(_SEED)
        yield
    finally:
        generator.set_state(saved_torch)
        random.setstate(saved_python)
        if numpy is not None:
            numpy.random.set_state(saved_numpy)


def value_digest(example: Any) -> int:
    """A 24-bit hash of the leaves of `example`: each tensor's (or array's) shape, dtype and up to
    `SAMPLES_PER_LEAF` evenly strided values as raw bytes, each number or string as written."""
    h = hashlib.blake2b(digest_size=3)
    for leaf in flatten(example):
        if not isinstance(leaf, torch.Tensor) and hasattr(leaf, "__array__"):
            leaf = torch.as_tensor(_as_array(leaf))  # a NumPy array, a PIL image
        if isinstance(leaf, torch.Tensor):
            flat = leaf.detach().reshape(-1)
            flat = flat[:: max(1, -(-flat.numel() // SAMPLES_PER_LEAF))].cpu().contiguous()
            h.update(f"{tuple(leaf.shape)}|{leaf.dtype}|".encode())
            h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
        elif leaf is None or isinstance(leaf, (bool, int, float, complex, str, bytes)):
            h.update(repr(leaf).encode())
        else:
            h.update(type(leaf).__qualname__.encode())  # its repr may hold an address, which differs per process
        h.update(b";")
    return int.from_bytes(h.digest(), "little")


def example_digest(dataset: Any, index: Any) -> int:
    """`value_digest` of `dataset[index]`, read in `fixed_random_state`. A read that raises gives the digest of the
    exception's type (the same on workers whose data sets fail alike): the check never fails a job by itself."""
    try:
        with fixed_random_state():
            example = dataset[index]
    except Exception as error:  # noqa: BLE001 - a read the user's loop never asked for must not end the job
        return value_digest(f"unreadable: {type(error).__qualname__}")
    return value_digest(example)


def _as_array(leaf: Any) -> Any:
    import numpy  # only for a leaf that offers __array__, which means NumPy is there

    return numpy.asarray(leaf)
