"""A data source that can resume mid-epoch: seeded, shuffled global batches with a position.

Resuming a training job EXACTLY needs the same global batches in the same order after a restart,
starting at the batch where the job stopped. `ShuffledBatches` makes that cheap: the order of
epoch `e` is a permutation drawn from a generator seeded by `(seed, e)` alone, so its whole
state is `(seed, epoch, offset)` and a restart jumps straight to a batch without reading the
ones before it.

A user's own loader takes part in resuming through the same three methods (duck typing):

- ``set_position(epoch, offset)``: the next iteration yields epoch `epoch` from batch `offset` on;
- ``state_dict()``: what fixes the order (seed, sizes), saved in checkpoints;
- ``load_state_dict(state)``: checks (or adopts) that order when a checkpoint is restored.

A loader without them still resumes: `fit` skips the batches already trained on in the
interrupted epoch, which is exact when the loader's order depends only on the epoch (a fixed
order, or a sampler with ``set_epoch`` as torch's ``DistributedSampler``).

Example:
    >>> batches = ShuffledBatches((x, y), batch_size=64, seed=0)
    >>> batches.set_position(epoch=2, offset=5)       # skip 5 batches of the third epoch
    >>> next(iter(batches))[0].shape
    torch.Size([64, 20])
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from stratagem.errors import InputError

# The seed of epoch e's order: a large prime stride keeps (seed, epoch) pairs from colliding for any
# realistic number of epochs.
_EPOCH_STRIDE = 1_000_003


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of the order of 0-based `epoch` for a source seeded with `seed`."""
    return seed * _EPOCH_STRIDE + epoch + 1


class ShuffledBatches:
    """GLOBAL batches of `batch_size` examples of `data`, reshuffled each epoch, resumable mid-epoch.

    Args:
        data: a tensor, a tuple/list of tensors sharing their first dimension, or a map-style
            dataset (``__len__`` and ``__getitem__`` returning tensors, e.g. ``TensorDataset``).
        batch_size: examples per GLOBAL batch; the last batch is short unless `drop_last`.
        shuffle: draw a new order each epoch (from `seed` and the epoch only), else keep the order.
        seed: fixes every epoch's order; the same seed gives the same batches run after run.
        drop_last: drop the last, short batch.

    Example:
        >>> batches = ShuffledBatches(TensorDataset(x, y), batch_size=256, seed=1)
        >>> history = sg.fit(strategy, model, optimizer, F.cross_entropy, batches, epochs=3)
    """

    def __init__(
        self, data: Any, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"batch_size must be a positive integer. Received: batch_size={batch_size!r}.")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InputError(f"seed must be an integer. Received: seed={seed!r}.")
        self._tensors, self._dataset = _as_tensors_or_dataset(data)
        self._single = isinstance(data, torch.Tensor)  # a lone tensor yields tensors, not 1-tuples
        self._num_examples = len(self._tensors[0]) if self._tensors is not None else len(self._dataset)
        if self._num_examples == 0:
            raise InputError("ShuffledBatches needs at least one example. Received: an empty data set.")
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.offset = 0
        if drop_last and len(self) == 0:
            raise InputError(
                f"drop_last=True leaves no batch: {self._num_examples} example(s) make no full batch of "
                f"{batch_size}. Received: batch_size={batch_size}. Lower batch_size or set drop_last=False."
            )

    @property
    def num_examples(self) -> int:
        return self._num_examples

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self._num_examples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    @property
    def batches_left(self) -> int:
        """Batches the next iteration yields: those of an epoch from the current position on."""
        return len(self) - self.offset

    def set_position(self, epoch: int, offset: int = 0) -> None:
        """The next iteration yields the batches of 0-based `epoch`, from batch `offset` on."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise InputError(f"epoch must be a non-negative integer. Received: epoch={epoch!r}.")
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= len(self):
            raise InputError(
                f"offset must be between 0 and the {len(self)} batches of an epoch. Received: offset={offset!r}."
            )
        self.epoch, self.offset = epoch, offset

    def set_epoch(self, epoch: int) -> None:
        """Start of 0-based `epoch` (torch's ``DistributedSampler`` spelling)."""
        self.set_position(epoch, 0)

    def state_dict(self) -> dict[str, Any]:
        """What fixes the batches: seed, sizes, and the current position."""
        return {
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_examples": self._num_examples,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "epoch": self.epoch,
            "offset": self.offset,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from a saved state; the data must be the same size and batched the same way.

        Raises:
            InputError: the saved batching differs from this source's (another batch size,
                data set size or shuffling), so resuming would train on other batches.
        """
        mine = self.state_dict()
        for key in ("batch_size", "num_examples", "shuffle", "drop_last"):
            if key in state and state[key] != mine[key]:
                raise InputError(
                    f"The saved data position was taken with {key}={state[key]!r} but this source has "
                    f"{key}={mine[key]!r}, so resuming would train on other batches. Build the source as before "
                    "(same data, batch_size, shuffle, drop_last), or remove the backup to start afresh."
                )
        self.seed = int(state.get("seed", self.seed))
        self.set_position(int(state.get("epoch", 0)), int(state.get("offset", 0)))

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self._num_examples)
        # A generator of its own: the order never depends on (or disturbs) the global torch RNG.
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        return torch.randperm(self._num_examples, generator=generator)

    def __iter__(self) -> Iterator[Any]:
        for indices in self.batch_indices():
            yield self.batch_of(indices)

    def batch_indices(self) -> Iterator[torch.Tensor]:
        """The example indices of each global batch that the next iteration would yield, in order.

        Moves the position as iterating does (a worker that reads only its part of each batch uses it).
        """
        # The position is read once: the iteration that starts now serves this epoch from this offset,
        # and the next iteration starts at the following epoch's beginning (as a DataLoader would).
        epoch, offset = self.epoch, self.offset
        self.epoch, self.offset = epoch + 1, 0
        order = self._order(epoch)
        for index in range(offset, len(self)):
            yield order[index * self.batch_size : (index + 1) * self.batch_size]

    def batch_of(self, indices: torch.Tensor) -> Any:
        """The batch of the examples at `indices`, built as this source builds its batches."""
        if self._tensors is not None:
            picked = tuple(t[indices] for t in self._tensors)
            return picked[0] if self._single else picked
        samples = [self._dataset[int(i)] for i in indices]
        return _collate(samples)

    def __repr__(self) -> str:
        return (
            f"ShuffledBatches(num_examples={self._num_examples}, batch_size={self.batch_size}, "
            f"shuffle={self.shuffle}, seed={self.seed}, epoch={self.epoch}, offset={self.offset})"
        )


def _as_tensors_or_dataset(data: Any) -> tuple[tuple[torch.Tensor, ...] | None, Any]:
    if isinstance(data, torch.Tensor):
        if data.dim() == 0:
            raise InputError(f"A data tensor needs a first (example) dimension. Received: shape {tuple(data.shape)}.")
        return (data,), None
    if isinstance(data, (tuple, list)) and data and all(isinstance(t, torch.Tensor) for t in data):
        sizes = {t.shape[0] if t.dim() else None for t in data}
        if len(sizes) != 1 or None in sizes:
            raise InputError(
                "The tensors of the data must share their first (example) dimension. "
                f"Received: shapes {[tuple(t.shape) for t in data]}."
            )
        return tuple(data), None
    if hasattr(data, "__len__") and hasattr(data, "__getitem__") and not isinstance(data, (str, bytes, dict)):
        return None, data
    raise InputError(
        "ShuffledBatches needs a tensor, a tuple of tensors sharing their first dimension, or a map-style data set "
        f"(with __len__ and __getitem__, e.g. TensorDataset). Received: {type(data).__name__}."
    )


def _collate(samples: Sequence[Any]) -> Any:
    first = samples[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(list(samples))
    if isinstance(first, (tuple, list)):
        return tuple(_collate([s[i] for s in samples]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _collate([s[k] for s in samples]) for k in first}
    return torch.as_tensor(list(samples))


def batches_left(data: Any) -> int | None:
    """How many batches one iteration of `data` yields, when it says so without being iterated; else None.

    A `ShuffledBatches` set to a position mid-epoch yields fewer batches than its ``len()`` (an epoch's).
    """
    left = getattr(data, "batches_left", None)
    if isinstance(data, ShuffledBatches) or isinstance(left, int):
        return left
    try:
        return len(data)
    except TypeError:
        return None
