"""A measuring process's peak memory over what it held before the workload's model was built.

On the CPU: the peak resident set (VmHWM) minus the resident set (VmRSS) at the start, after the peak was reset
(`/proc/self/clear_refs`, Linux) and one tiny training step warmed the runtime, so that imports, the process group
and the first step's one-off allocations, the same for every strategy, do not count;
every replica of an in-process strategy counts in its one process. On a GPU: torch's peak allocated memory on the
process's device over what was allocated at the start. Figures hold under CPU load, unlike times.

Example:
    >>> memory = PeakMemory.start("cpu")                     # doctest: +SKIP
    >>> ...                                                    # build, distribute, train
    >>> memory.peak()                                          # bytes, or None where it cannot be read
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PeakMemory:
    """Where a measurement started: its device kind, device and baseline bytes."""

    kind: str
    device: str
    baseline: int | None

    @classmethod
    def start(cls, kind: str, device: str = "cpu") -> PeakMemory:
        """Resets the peak and records the baseline, just before the workload's model is built."""
        if kind == "gpu":
            torch.cuda.reset_peak_memory_stats(device)
            return cls(kind, device, torch.cuda.memory_allocated(device))
        _warm_up_runtime()
        # Where the peak cannot be reset, VmHWM may be an earlier peak's: no baseline, and `peak()` says None.
        return cls(kind, device, _status_bytes("VmRSS") if _reset_peak_rss() else None)

    def peak(self) -> int | None:
        """Bytes over the baseline at the peak since `start` (None where the platform does not tell)."""
        if self.kind == "gpu":
            return torch.cuda.max_memory_allocated(self.device) - (self.baseline or 0)
        peak = _status_bytes("VmHWM")
        return None if peak is None or self.baseline is None else max(peak - self.baseline, 0)


def _warm_up_runtime() -> None:
    """One tiny step of a linear and a convolutional layer with SGD: the runtime's one-off allocations (oneDNN's
    kernels and scratch, autograd's and the thread pool's), 70-75 MiB measured, the same for every strategy, are
    made before the baseline rather than counted as the model's."""
    from torch import nn

    for layer, x in ((nn.Linear(8, 8), torch.randn(4, 8)), (nn.Conv2d(3, 4, 3), torch.randn(2, 3, 8, 8))):
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
        layer(x).sum().backward()
        optimizer.step()


def _reset_peak_rss() -> bool:
    """Resets VmHWM to the current resident set ("5", Linux 4.0+); False where the system refuses it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
