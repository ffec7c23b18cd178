"""Each worker's clock offset to the chief's, measured through the job's store.

The chief answers each worker in turn: it sets `turn/<rank>`, then for each ping of that worker writes its
own clock's time as the pong. The worker times each round trip on its own clock (t0 before the ping, t1
after the pong): the chief's time lies inside [t0, t1] whatever the delays each way, so
`offset = chief - (t0 + t1) / 2` is wrong by at most `(t1 - t0) / 2`. The sample with the least round trip
is kept (NTP's rule). Every worker calls `align` at the same point of its program (the start of a trace).

    >>> offset = align(store, rank=1, world_size=2, clock=time.perf_counter_ns, round_id="t0")
    >>> offset.offset_ns, offset.error_ns        # chief's clock = this clock + offset_ns, within error_ns

Where the chief can ask the other processes for their time (a parameter-server job's RPCs), it measures each
one's offset itself, by the same rule (`measure`), and tells it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from stratagem.trace.recorder import Clock

SAMPLES = 16
"""Round trips per worker; the least-delay one is kept."""

_KEY = "stratagem/trace/clock/{round}/{what}/{rank}/{i}"


@dataclass(frozen=True)
class ClockOffset:
    """This worker's clock against the chief's: chief = local + `offset_ns`, within `error_ns`."""

    offset_ns: int
    error_ns: int
    samples: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def align(
    store: Any,
    *,
    rank: int,
    world_size: int,
    clock: Clock,
    round_id: str,
    samples: int = SAMPLES,
    timeout: float = 60.0,
) -> ClockOffset:
    """Measures this worker's clock offset to the chief's (rank 0) through `store` (set/get/wait of a
    torch.distributed store); every rank calls it with the same `round_id`. The chief's own offset is 0."""
    if samples < 1:
        raise ValueError(f"align() needs at least one round trip. Received: samples={samples}. Pass 1 or more.")
    wait = timedelta(seconds=timeout)
    if rank == 0:
        for peer in range(1, world_size):
            store.set(_KEY.format(round=round_id, what="turn", rank=peer, i=0), "1")
            for i in range(samples):
                store.wait([_KEY.format(round=round_id, what="ping", rank=peer, i=i)], wait)
                store.set(_KEY.format(round=round_id, what="pong", rank=peer, i=i), str(clock()))
        return ClockOffset(0, 0, 0)
    store.wait([_KEY.format(round=round_id, what="turn", rank=rank, i=0)], wait)
    best = (2**63, 0)  # (round trip, offset) of the least-delay sample
    for i in range(samples):
        t0 = clock()
        store.set(_KEY.format(round=round_id, what="ping", rank=rank, i=i), "1")
        chief = int(store.get(_KEY.format(round=round_id, what="pong", rank=rank, i=i)))
        t1 = clock()
        sample = (t1 - t0, chief - (t0 + t1) // 2)
        if sample[0] < best[0]:
            best = sample
    return ClockOffset(offset_ns=best[1], error_ns=(best[0] + 1) // 2, samples=samples)


def measure(ask: Callable[[], int], *, clock: Clock, samples: int = SAMPLES) -> ClockOffset:
    """Another process's clock against this one, by `samples` round trips of `ask()` (which returns that clock's
    time, e.g. through an RPC), the least-delay one kept as in `align`. The result is the other's offset: this
    clock = the other's + `offset_ns`, within `error_ns` (what that process writes in its file when this one is
    the chief)."""
    if samples < 1:
        raise ValueError(f"measure() needs at least one round trip. Received: samples={samples}. Pass 1 or more.")
    best = (2**63, 0)  # (round trip, offset) of the least-delay sample
    for _ in range(samples):
        t0 = clock()
        theirs = ask()
        t1 = clock()
        sample = (t1 - t0, (t0 + t1) // 2 - theirs)
        if sample[0] < best[0]:
            best = sample
    return ClockOffset(offset_ns=best[1], error_ns=(best[0] + 1) // 2, samples=samples)
