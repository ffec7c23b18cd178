"""The phase of compute a straggler is slow in, from the trace while one records (`stratagem.trace`).

`worker_group/stragglers.py` names a straggler in input, compute or communication from phase times every worker
keeps. Inside compute it cannot tell forward from backward: the gradient sum runs inside backward, so a peer's
backward lasts as long as the straggler's. A trace can: its painted timeline gives each phase's own work with the
waits taken out (`timeline.py`). While a trace records, each worker's last complete step's own forward, backward and
optimizer time ride the gradient sum beside the phase times (`SLOT` numbers in a slot of its own, in milliseconds,
zeros while nothing records), and a straggler named in compute is given the sub-phase whose median exceeds its
peers' most, when that accounts for at least half its excess.

    >>> phases = ComputePhases(world_size=2)
    >>> phases.numbers(rank, recorder)          # this worker's slot of the sum
    >>> phases.observe(summed_slice); phases.refine(straggler)
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Sequence

from stratagem.strategies.worker_group.stragglers import Straggler
from stratagem.trace import Recorder

PHASES = ("forward", "backward", "optimizer")
SLOT = len(PHASES)


class ComputePhases:
    """Every worker's own forward, backward and optimizer time per step, from the summed slots; `refine`."""

    def __init__(self, *, world_size: int, window: int = 10, share: float = 0.5) -> None:
        self.world_size = world_size
        self.share = share
        self._history: collections.deque[list[list[float]]] = collections.deque(maxlen=window)

    @property
    def size(self) -> int:
        return SLOT * self.world_size

    def numbers(self, rank: int, recorder: Recorder | None) -> list[float]:
        """Every worker's slot, this worker's holding its last traced step's own phase times (ms), the rest zero."""
        out = [0.0] * self.size
        # `recording`, not `on`: a sampled trace (`trace/sample.py`) sends its last recorded step between samples.
        phases = recorder.last_step_phases() if recorder is not None and recorder.recording else None
        if phases is not None:
            out[rank * SLOT : (rank + 1) * SLOT] = [phases[p] / 1e6 for p in PHASES]
        return out

    def observe(self, summed: Sequence[float]) -> None:
        """One step's summed slots; kept while every worker had a traced step (else the history restarts)."""
        per_worker = [list(summed[r * SLOT : (r + 1) * SLOT]) for r in range(self.world_size)]
        if any(not any(times) for times in per_worker):
            self._history.clear()
            return
        self._history.append(per_worker)

    def refine(self, straggler: Straggler) -> Straggler:
        """`straggler` with `detail`, the phase of compute it is slow in, when the trace shows one (else as it is)."""
        if straggler.phase != "compute" or len(self._history) < self._history.maxlen // 2:  # type: ignore[operator]
            return straggler
        medians = [
            [statistics.median(entry[r][p] for entry in self._history) for p in range(SLOT)]
            for r in range(self.world_size)
        ]
        mine = medians[straggler.rank]
        peers = [m for r, m in enumerate(medians) if r != straggler.rank]
        excess = [mine[p] - statistics.median(m[p] for m in peers) for p in range(SLOT)]
        best = max(range(SLOT), key=lambda p: excess[p])
        if excess[best] < self.share * straggler.excess_ms:
            return straggler
        return dataclasses.replace(straggler, detail=PHASES[best])
