"""`seed_everything`: one call that seeds every random generator a stratagem run draws from.

What it seeds, in this process:
- Python's `random` and NumPy's global generator (when NumPy is installed);
- torch's CPU generator and the generator of every CUDA device (`torch.manual_seed`), so each
  replica on its own GPU draws from its own device's generator, in a fixed order;
- DataLoader worker processes (``num_workers > 0``) through torch: each worker's `random`, NumPy
  and torch generators are seeded from the loader's base seed, which is drawn from the seeded
  torch generator, so a shuffled loader yields the same batches run after run.

Every worker of a multi-worker job calls it with the same seed, and gets the same generators:
with the default sharding every worker iterates the same global batches, so their shuffles must
agree (the chief's initial parameters are broadcast anyway). Replicas on logical CPU devices share
the process's one CPU generator: random operations inside the step function (dropout) then draw
in the order the replica threads reach them, which is not fixed; everything drawn outside the
step (initialisation, shuffling, augmentation in the loader) is reproducible.

Example:
    >>> sg.seed_everything(0)
    >>> net = Net()                                           # the same initial weights every run
    >>> loader = DataLoader(data, batch_size=64, shuffle=True, num_workers=2)   # the same order
"""

from __future__ import annotations

import logging
import random
import sys

import torch

from stratagem.errors import InputError

logger = logging.getLogger(__name__)

MAX_SEED = 2**32 - 1
"""NumPy's generator takes seeds in [0, 2**32)."""


def seed_everything(seed: int) -> int:
    """Seeds Python's `random`, NumPy, torch (CPU and every CUDA device) with `seed`; returns it.

    Example:
        >>> sg.seed_everything(1234)
        1234
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise InputError(f"seed must be a whole number in [0, {MAX_SEED}]. Received: seed={seed!r}. Use e.g. seed=0.")
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # NumPy is optional for torch; a run without it draws nothing from it
        pass
    else:
        numpy.random.seed(seed)
    torch.manual_seed(seed)  # the CPU generator and, lazily, every CUDA device's
    seeded = ["python random", "torch (cpu and every cuda device)"] + (["numpy"] if "numpy" in sys.modules else [])
    logger.info("Seeded %s with %d.", ", ".join(seeded), seed)
    return seed
