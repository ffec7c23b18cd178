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


class _CountingCondition(threading.Condition):
    """The barrier's condition, counting the times a waiting replica is woken."""

    def __init__(self) -> None:
        super().__init__()
        self.woken = 0

    def notify_all(self) -> None:
        if self._waiters:  # type: ignore[attr-defined]
            self.woken += 1
        super().notify_all()


def _wait_until(condition, timeout: float = 10.0) -> None:
    deadline = threading.Event()
    for _ in range(int(timeout / 0.005)):
        if condition():
            return
        deadline.wait(0.005)
    raise AssertionError("the other replica never got there")


def test_a_gradient_ready_notice_wakes_a_replica_waiting_to_steal_and_leaves_a_batch_norm_wait_asleep() -> None:
    # At a BatchNorm meeting in the middle of backward a replica waits without work to steal: the other replica's
    # gradient hooks (notify) must not wake it, which would take a core and the global lock from the replica it
    # waits for. At the end of backward a waiting replica steals work, and each notice must wake it.
    barrier = ReplicaBarrier(["cpu:0", "cpu:1"], timeout=10)
    counting = _CountingCondition()
    barrier._cond = counting  # the test's own instrument of the barrier's lock
    updates: list[int] = []
    waiting = threading.Thread(target=barrier.wait, args=(0, "BatchNorm statistics of 'bn' (backward)", 1))
    waiting.start()
    _wait_until(lambda: barrier._arrived == {0})
    for i in range(5):
        barrier.notify(lambda i=i: updates.append(i))
    assert updates == [0, 1, 2, 3, 4]  # the updates ran
    assert counting.woken == 0
    barrier.wait(1, "BatchNorm statistics of 'bn' (backward)", 1)  # the meeting completes: one wake-up
    waiting.join(10)
    assert counting.woken == 1

    looked: list[int] = []

    def steal():
        looked.append(len(looked))
        return None

    stealing = threading.Thread(target=barrier.wait, args=(0, "end of backward", 1, steal))
    stealing.start()
    _wait_until(lambda: len(looked) == 1)
    barrier.notify(lambda: None)
    _wait_until(lambda: len(looked) == 2)  # woken, it looked for work again
    barrier.wait(1, "end of backward", 1)
    stealing.join(10)
    assert not stealing.is_alive() and not waiting.is_alive()
