"""The meeting of one process's replicas: what the last replica to arrive runs for all of them."""

from __future__ import annotations

import threading

import pytest

from stratagem.strategies.data_parallel.replicas import ReplicaBarrier


def test_the_last_to_arrive_runs_the_combination_once_before_any_replica_leaves() -> None:
    results: list = []
    calls: list = []

    def combination(r: int):
        def run() -> None:
            calls.append(r)
            results.append(f"sum by {r}")

        return run

    n = 3
    barrier = ReplicaBarrier([f"cpu:{r}" for r in range(n)], timeout=10)
    ran = results
    seen: list = [None] * n
    gate = threading.Barrier(n - 1)

    def replica(r: int) -> None:
        if r != 0:
            gate.wait(10)
        barrier.wait(r, "meeting", 1, last=combination(r))
        seen[r] = list(ran)

    late = threading.Thread(target=replica, args=(0,))
    early = [threading.Thread(target=replica, args=(r,)) for r in range(1, n)]
    for t in early:
        t.start()
    # Replica 0 starts only once the others have had time to arrive; whoever arrives last runs the combination.
    for t in early:
        t.join(0.5)
    late.start()
    for t in [late, *early]:
        t.join(10)
    assert len(calls) == 1
    assert seen == [[f"sum by {calls[0]}"]] * n  # every replica left after the combination, and saw its result


def test_an_error_in_the_combination_fails_every_replica_of_the_meeting() -> None:
    n = 2
    barrier = ReplicaBarrier([f"cpu:{r}" for r in range(n)], timeout=10)
    errors: dict = {}

    def fail() -> None:
        raise ValueError("Expected more than 1 value per channel")

    def replica(r: int) -> None:
        try:
            barrier.wait(r, "meeting", 1, last=fail)
        except BaseException as exc:  # noqa: BLE001 - recorded for the test
            errors[r] = exc

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(errors) == [0, 1]
    direct = [e for e in errors.values() if isinstance(e, ValueError)]
    assert len(direct) == 1  # the last to arrive raises it; the other fails with it as the cause
    other = next(e for e in errors.values() if not isinstance(e, ValueError))
    assert other.__cause__ is direct[0]
    with pytest.raises(Exception) as later:
        barrier.wait(0, "meeting", 1)
    assert later.value.__cause__ is direct[0]
