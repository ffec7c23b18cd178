"""A worker slower than its peers is named, with the phase it is slow in, while training continues; no false
alarm on clean steps; a slow worker is never called lost at the timeout (issue 28, item 6). Real processes on
127.0.0.1 under `stratagem launch`, and the rule on synthetic steps."""

from __future__ import annotations

import random

import pytest
from helpers import launch_json_workers

from stratagem.strategies.worker_group.stragglers import StragglerWatch


def _launched(**settings) -> tuple[int, dict[int, dict], list[str]]:
    return launch_json_workers("mwms_straggler.py", settings, timeout=150)


def _synthetic(watch: StragglerWatch, steps: int, times) -> list:
    named = []
    for step in range(1, steps + 1):
        summed = [ms for r in range(watch.world_size) for ms in times(step, r)]
        found = watch.observe(summed, step)
        if found is not None:
            named.append(found)
    return named


def test_no_false_alarm_over_500_noisy_clean_steps_of_three_workers():
    rng = random.Random(0)
    watch = StragglerWatch(rank=0, task_names=["worker:0", "worker:1", "worker:2"])

    def noisy(step, rank):
        # 5 ms of compute with heavy-tailed noise: one step in ten takes 30 ms more on one worker (a loaded machine)
        spike = 30.0 if rng.random() < 0.1 else 0.0
        return [rng.uniform(0.1, 0.5), rng.uniform(4.0, 6.0) + spike, rng.uniform(0.5, 3.0)]

    assert _synthetic(watch, 500, noisy) == [] and watch.current is None


def test_a_worker_50_ms_slower_in_compute_is_named_within_12_steps_and_its_peer_is_not():
    watch = StragglerWatch(rank=1, task_names=["worker:0", "worker:1"])

    def times(step, rank):  # worker:0 waits for worker:1 in the gradient sum
        return [0.2, 55.0, 1.0] if rank == 1 else [0.2, 5.0, 51.0]

    named = _synthetic(watch, 30, times)
    assert [(s.task, s.phase, s.step) for s in named] == [("worker:1", "compute", watch.window + watch.confirm - 1)]
    assert named[0].excess_ms == pytest.approx(50.0)
    assert (
        "worker:1 (rank 1) is a straggler at step 12: 50 ms a step slower than its peers in compute"
        in named[0].describe()
    )


def test_a_slow_input_is_named_as_input():
    watch = StragglerWatch(rank=0, task_names=["worker:0", "worker:1", "worker:2"])
    named = _synthetic(watch, 20, lambda step, r: [60.0, 5.0, 1.0] if r == 2 else [1.0, 5.0, 60.0])
    assert [(s.task, s.phase) for s in named] == [("worker:2", "input")]


def test_slow_communication_is_named_only_when_the_worker_is_not_just_waiting():
    watch = StragglerWatch(rank=0, task_names=["worker:0", "worker:1", "worker:2"])
    # worker:1's own sums take 40 ms longer while its work is as long as its peers': slow in communication.
    named = _synthetic(watch, 20, lambda step, r: [1.0, 10.0, 45.0] if r == 1 else [1.0, 10.0, 5.0])
    assert [(s.task, s.phase) for s in named] == [("worker:1", "communication")]
    waiting = StragglerWatch(rank=0, task_names=["worker:0", "worker:1"])
    # worker:0 waits 40 ms for worker:1, which computes 40 ms longer: only worker:1 is named, in compute.
    named = _synthetic(waiting, 20, lambda step, r: [1.0, 50.0, 5.0] if r == 1 else [1.0, 10.0, 45.0])
    assert [(s.task, s.phase) for s in named] == [("worker:1", "compute")]


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_worker_sleeping_50_ms_in_its_step_is_named_in_compute_within_20_steps():
    code, outcomes, lines = _launched(ST_SLOW_RANK=1, ST_SLOW_MS=50, ST_STEPS=30)
    assert code == 0, "\n".join(lines[-30:])
    for outcome in outcomes.values():  # every worker knows; the chief logs it
        first = outcome["stragglers"][0]
        assert (first["task"], first["phase"]) == ("worker:1", "compute"), outcome
        assert first["step"] <= 20 and first["excess_ms"] >= 40, outcome
    assert any("worker:1 (rank 1) is a straggler at step" in line and "in compute" in line for line in lines), lines


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_worker_slow_in_its_input_is_named_in_input():
    code, outcomes, lines = _launched(ST_SLOW_RANK=0, ST_SLOW_MS=50, ST_PHASE="input", ST_STEPS=30)
    assert code == 0, "\n".join(lines[-30:])
    first = outcomes[0]["stragglers"][0]
    assert (first["task"], first["phase"]) == ("worker:0", "input") and first["step"] <= 20, outcomes


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_clean_fast_steps_raise_no_straggler():
    code, outcomes, lines = _launched(ST_STEPS=150)
    assert code == 0, "\n".join(lines[-30:])
    assert [o["stragglers"] for o in outcomes.values()] == [[], []], outcomes


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_slow_but_alive_worker_at_the_timeout_is_reported_behind_not_lost():
    # Before: "lost: worker:1 (rank 1)" although worker:1 was only sleeping inside its step.
    code, outcomes, lines = _launched(ST_SLOW_RANK=1, ST_SLOW_MS=0, ST_STALL_STEP=3, ST_STALL_S=12, ST_TIMEOUT=4)
    assert code != 0
    message = outcomes[0]["message"]
    assert (
        "alive but behind (slow, not gone: its pulse still moves): worker:1 (rank 1) at step 4, still working"
        in message
    ), message
    assert "lost" not in message, message
    warned = [line for line in lines if "has waited" in line and "steps reached" in line]
    assert warned and "behind: worker:1" in warned[0], lines
