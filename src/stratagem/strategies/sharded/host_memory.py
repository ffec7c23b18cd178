"""What a ShardedStrategy process does with the host memory its steps free: give it back, or keep it for the next.

`host_memory="release"` (the default): blocks of 64 KiB and more are mapped alone and unmapped when freed
(`allocator.map_large_blocks_here`), so the resident set follows the live tensors and the memory plan is the
process's peak. The price is that every step maps its gathered units, gradients, collective buffers and optimizer
temporaries afresh, and the kernel faults each page in and zeroes it: on 12 x Linear(2048, 2048) at stage 2 over
2 workers, 278,000 page faults and 0.43 s of system CPU per step and rank, against 0.28 s of user CPU.

`host_memory="reuse"`: the same until the first optimizer step has made the optimizer's state, so that the
shards, their state and everything else that lives for the whole run are mapped alone, out of the heap's way;
from then on blocks up to 32 MiB come from the heap and a freed block is kept for the next step's block of its
size (`allocator.reuse_freed_blocks_here`): no page faults after that step. What the heap then holds is the step's
transients, placed by glibc, so the peak is above the plan by the heap's fragmentation (on that MLP, 15-35% over
20 steps; benchmarks/reports/2026-12-07-cpu-2vcpu-sharded-speed.md), which is why it is a choice and not the default.
"""

from __future__ import annotations

import weakref

import torch

from stratagem.cluster import allocator
from stratagem.diagnose import PlacementDecision
from stratagem.errors import InputError

CHOICES = ("release", "reuse")


def check_host_memory(value: object) -> str:
    """`value` as one of `CHOICES`, refused otherwise."""
    if value not in CHOICES:
        raise InputError(
            "ShardedStrategy's host_memory says what a process does with the host memory its steps free. "
            f"Received: host_memory={value!r}. Use 'release' (the default: the resident set follows the live "
            "tensors, as the memory plan assumes) or 'reuse' (freed blocks kept for the next step after the first "
            "optimizer step: no page faults, a peak above the plan by the heap's fragmentation)."
        )
    return str(value)


class HostMemory:
    """Switches this process to reusing freed blocks after the first step that left every optimizer it watches
    with state, when `choice` is "reuse" and the strategy's mapping of large blocks (`mapped`) took effect."""

    def __init__(self, choice: str, mapped: tuple[bool, str]) -> None:
        self.choice = choice
        self._mapped = mapped
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self.reusing = False

    def watch(self, optimizer: torch.optim.Optimizer | None) -> None:
        """An optimizer whose state is made in its first step: the switch waits for it."""
        if optimizer is not None:
            self._optimizers.append(weakref.ref(optimizer))

    def after_step(self) -> None:
        """Called after every step; switches once, when the optimizers' state exists."""
        if self.reusing or self.choice != "reuse" or not self._mapped[0]:
            return
        optimizers = [o for o in (ref() for ref in self._optimizers) if o is not None]
        if all(o.state for o in optimizers):
            self.reusing = allocator.reuse_freed_blocks_here()

    def allocator(self) -> str:
        """What the memory plan assumes of the allocator, for its `allocator` field."""
        applied, why = self._mapped
        if not applied:
            return f"not planned for: {why}"
        if self.choice == "release":
            return why
        return (
            f"{why} until the optimizer's state exists; then freed blocks up to 32 MiB kept in the heap for the next "
            "step (host_memory='reuse'): the peak is above this plan by the heap's fragmentation, not planned"
        )

    def decision(self) -> PlacementDecision:
        """The choice, for `explain()`."""
        if self.choice == "release":
            reason = (
                "freed blocks of 64 KiB and more go back to the system at once, so the resident set follows the "
                "plan; each step faults its large blocks in afresh. host_memory='reuse' keeps them for the next step "
                "(faster, a peak above the plan)"
            )
        else:
            reason = (
                "after the first optimizer step, freed blocks stay in the heap for the next step: no page faults, "
                "a peak above the memory plan by the heap's fragmentation. host_memory='release' keeps the plan"
            )
        if not self._mapped[0]:
            reason = f"neither applies: {self._mapped[1]}"
        return PlacementDecision(subject="host memory freed by a step", choice=self.choice, reason=reason)
