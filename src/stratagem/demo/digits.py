"""The digits demo's data and model: scikit-learn's 8x8 handwritten digits and a small conv net.

The data set ships inside scikit-learn (1797 images, no download), so ``stratagem train`` runs
anywhere, offline, in seconds, and still shows a real learning curve.

Example:
    >>> data = load_digits_data()
    >>> data.train_x.shape, data.test_x.shape
    (torch.Size([1437, 1, 8, 8]), torch.Size([360, 1, 8, 8]))
    >>> model = build_digits_model(seed=0)
    >>> model(data.test_x[:4]).shape
    torch.Size([4, 10])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from stratagem.errors import InputError

if TYPE_CHECKING:
    from stratagem.strategies.tensor_parallel.mesh import LayoutMap

NUM_CLASSES = 10
TEST_FRACTION = 0.2
SPLIT_SEED = 0
"""The train/test split is fixed, whatever the training seed, so test accuracies of runs with
different seeds are measured on the same 360 images."""

# The pixels of load_digits are integers 0..16.
_MAX_PIXEL = 16.0


@dataclass(frozen=True)
class DigitsData:
    """The digits split into train and test tensors: images (N, 1, 8, 8) in [0, 1], labels (N,) int64."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def load_digits_data(test_fraction: float = TEST_FRACTION) -> DigitsData:
    """Loads scikit-learn's digits, scales pixels to [0, 1] and splits them, stratified by class.

    Raises:
        InputError: ``test_fraction`` is not strictly between 0 and 1.
        ImportError: scikit-learn is not installed (the message says how to install it).
    """
    if not 0.0 < test_fraction < 1.0:
        raise InputError(
            f"test_fraction must be strictly between 0 and 1. Received: test_fraction={test_fraction!r}. "
            "Use e.g. 0.2 for a 80/20 split."
        )
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as error:
        raise ImportError(
            f"The digits data set comes from scikit-learn, which cannot be imported ({error}). "
            "Install it with: pip install 'stratagem[train]' (or pip install scikit-learn)."
        ) from error
    images, labels = load_digits(return_X_y=True)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=test_fraction, random_state=SPLIT_SEED, stratify=labels
    )
    return DigitsData(_images(train_x), _labels(train_y), _images(test_x), _labels(test_y))


def _images(array) -> torch.Tensor:
    return (torch.as_tensor(array, dtype=torch.float32) / _MAX_PIXEL).reshape(-1, 1, 8, 8).contiguous()


def _labels(array) -> torch.Tensor:
    return torch.as_tensor(array, dtype=torch.int64)


def build_digits_model(seed: int) -> nn.Module:
    """A small conv net for 1x8x8 images: two 3x3 convolutions, a 2x2 max-pool, two dense layers.

    The weights depend only on ``seed``; the global torch random state is left untouched.
    """
    # fork_rng: seeding the initialisation must not reseed the caller's global generator.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Conv2d(1, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, 128),
            nn.ReLU(),
            nn.Linear(128, NUM_CLASSES),
        )


DIGITS_LAYOUTS: dict[str, tuple[str | None, ...]] = {
    r"^6\.weight$": ("model", None),
    r"^6\.bias$": ("model",),
    r"^8\.weight$": (None, "model"),
}
"""How ``stratagem train --strategy tensor_parallel`` splits `build_digits_model`'s net across the `model` axis: the
first dense layer by its output features, the second by its input features (Megatron's column then row split: the
hidden activations are 1/N per worker and one all-reduce of the logits' partial sums ends the forward); the
convolutions and the last bias stay replicated. The keys are regular expressions over ``named_parameters()``."""


def digits_layout_map() -> LayoutMap:
    """`DIGITS_LAYOUTS` as an `sg.LayoutMap` over one `model` axis of every worker."""
    from stratagem.strategies.tensor_parallel.mesh import LayoutMap

    layout_map = LayoutMap()
    for key, layout in DIGITS_LAYOUTS.items():
        layout_map[key] = layout
    return layout_map


def make_loader(x: torch.Tensor, y: torch.Tensor, batch_size: int, *, shuffle: bool, seed: int = 0) -> DataLoader:
    """A loader of GLOBAL batches of ``(x, y)``; with ``shuffle`` the order depends only on ``seed``.

    The last batch is kept even when short: strategies split uneven batches exactly.

    Raises:
        InputError: ``batch_size`` is not a positive integer.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be a positive integer. Received: batch_size={batch_size!r}.")
    # A generator of its own, so the shuffle order is reproducible and independent of other torch randomness.
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle, generator=generator)
