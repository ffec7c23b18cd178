"""How float32 math and random numbers behave on GPU replicas: stated by `explain()`, made reproducible.

TF32. On NVIDIA GPUs since Ampere, torch may run float32 matrix products and cuDNN convolutions in
TF32 (inputs rounded to 10 mantissa bits). The switches are process-wide and belong to the user
(``torch.backends.cuda.matmul.allow_tf32``, off by default; ``torch.backends.cudnn.allow_tf32``, on
by default), so a strategy leaves them as they are and `tf32_decision` states them: the promise
that N replicas match one device in float32 to 1e-5 holds with both off.

Random streams. ``torch.manual_seed(s)`` seeds every GPU's generator with the same ``s``, so
replicas on different GPUs would draw the same dropout masks for different examples. At
``distribute`` each GPU replica but the first (in global replica order) gets its GPU's generator
seeded with ``initial_seed + replica * REPLICA_SEED_STRIDE``: distinct streams, the same on every
run with the same seed, and replica 0 keeps torch's own stream (one replica equals plain torch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from stratagem.diagnose import PlacementDecision

REPLICA_SEED_STRIDE = 0x9E3779B97F4A7C15
"""Added per replica to the base seed (the golden-ratio constant: consecutive seeds far apart)."""


def tf32_decision(devices: Sequence[torch.device]) -> PlacementDecision | None:
    """Whether float32 matmuls and convolutions may use TF32 on these replicas' GPUs; None without a GPU."""
    if not any(d.type == "cuda" for d in devices):
        return None
    matmul = _flag(lambda: torch.backends.cuda.matmul.allow_tf32)
    conv = _flag(lambda: torch.backends.cudnn.allow_tf32)
    choice = f"matmul {_word(matmul)}, cuDNN convolutions {_word(conv)}"
    if matmul is False and conv is False:
        why = (
            "float32 runs in full float32, so replicas match one device to 1e-5 as promised "
            "(torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32 are off)"
        )
    else:
        why = (
            "torch's process-wide switches, left as set: with TF32 on, float32 matmuls/convolutions round their "
            "inputs to 10 mantissa bits, so float32 results differ from one device by more than 1e-5; set "
            "torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False for exact float32"
        )
    return PlacementDecision(subject="TF32", choice=choice, reason=why)


def replica_seed(base: int, replica: int) -> int:
    """The seed of global replica `replica`'s GPU generator when the program's base seed is `base`."""
    return (base + replica * REPLICA_SEED_STRIDE) % (2**63)


def seed_replica_streams(
    devices: Sequence[torch.device], first_replica: int, seed_device: Callable[[int, int], None] | None = None
) -> PlacementDecision | None:
    """Gives each GPU replica its own reproducible random stream (see the module docstring).

    `first_replica` is the global index of this process's first replica (rank * local replicas under
    MultiWorkerMirroredStrategy). Returns the decision for `explain()`; None without a GPU replica.
    """
    gpus = [(first_replica + r, d) for r, d in enumerate(devices) if d.type == "cuda"]
    if not gpus:
        return None
    if len({d for _, d in gpus}) != len(gpus):
        return PlacementDecision(
            subject="random streams",
            choice="shared per GPU",
            reason=(
                "several replicas share a GPU and so its one generator: they draw from it in the order their "
                "threads run, which differs from run to run (dropout is then not reproducible)"
            ),
        )
    seed_device = seed_device or _seed_device
    base = torch.initial_seed()
    for replica, device in gpus:
        if replica != 0:
            seed_device(device.index or 0, replica_seed(base, replica))
    return PlacementDecision(
        subject="random streams",
        choice="one per replica",
        reason=(
            "each GPU replica's generator is seeded with the base seed + replica x 0x9E3779B97F4A7C15 at "
            "distribute() (replica 0 keeps torch's own stream): dropout differs across replicas and repeats from "
            "run to run; call torch.manual_seed before distribute()"
        ),
    )


def _seed_device(index: int, seed: int) -> None:
    with torch.cuda.device(index):
        torch.cuda.manual_seed(seed)


def _flag(read: Callable[[], bool]) -> bool | None:
    try:
        return bool(read())
    except Exception:  # noqa: BLE001 - a torch that cannot say is reported as unknown
        return None


def _word(flag: bool | None) -> str:
    return {True: "on", False: "off", None: "unknown"}[flag]
