"""The straggler warning refined by the trace (issue 42, item 4): while a trace records, a straggler named in
compute is given the phase of compute it is slow in, from every worker's own forward, backward and optimizer time
with the waits painted out. Synthetic steps, no process group; tests/test_trace_multi_worker.py runs it on real
workers."""

from __future__ import annotations

import pytest

from stratagem.strategies.multi_worker.straggler_phases import ComputePhases
from stratagem.strategies.worker_group.stragglers import StragglerWatch
from stratagem.trace import Recorder

MS = 1_000_000


def _named(phase_times, *, steps: int = 20):
    """Two workers, worker:1 50 ms slower in compute at every step (worker:0 waits for it in the gradient sum);
    `phase_times(rank)`: each worker's own (forward, backward, optimizer) ms, or None while nothing is traced."""
    watch, phases = StragglerWatch(rank=0, task_names=["worker:0", "worker:1"]), ComputePhases(world_size=2)
    named = []
    for step in range(1, steps + 1):
        phases.observe([ms for rank in (0, 1) for ms in (phase_times(rank) or (0.0, 0.0, 0.0))])
        found = watch.observe([0.2, 5.0, 51.0] + [0.2, 55.0, 1.0], step, refine=phases.refine)
        if found is not None:
            named.append(found)
    return named


def test_a_straggler_in_compute_is_given_the_phase_the_trace_shows():
    named = _named(lambda rank: (1.0, 3.0 + (50.0 if rank == 1 else 0.0), 0.5))
    assert [(s.task, s.phase, s.detail) for s in named] == [("worker:1", "compute", "backward")]
    assert "slower than its peers in compute (backward, by the trace)" in named[0].describe()
    assert named[0].to_dict()["detail"] == "backward"
    forward = _named(lambda rank: (1.0 + (50.0 if rank == 1 else 0.0), 3.0, 0.5))
    assert [s.detail for s in forward] == ["forward"]


def test_without_a_trace_or_with_the_excess_spread_out_no_phase_is_claimed():
    assert [(s.task, s.phase, s.detail) for s in _named(lambda rank: None)] == [("worker:1", "compute", None)]
    spread = _named(lambda rank: (1.0 + (20.0 if rank == 1 else 0.0), 3.0 + (20.0 if rank == 1 else 0.0), 0.5))
    assert [s.detail for s in spread] == [None]  # neither phase holds half of the 50 ms


def test_a_recorder_gives_its_last_steps_own_work_with_the_waits_painted_out():
    for mode in ("spans", "summary"):
        rec = Recorder(rank=0, task="worker:0")
        rec.start(mode=mode)
        assert rec.last_step_phases() is None
        for step in (1, 2):
            base = step * 100 * MS
            rec.at_step(step)
            rec.span("forward", "forward", base + 1 * MS, base + 3 * MS, track="main")
            rec.span("wait", "gradients", base + 5 * MS, base + 9 * MS, track="main", args={"seqs": []})
            rec.span("backward", "backward", base + 3 * MS, base + 10 * MS, track="main")
            rec.span("optimizer", "optimizer step", base + 10 * MS, base + 11 * MS, track="main")
            rec.span("step", f"step {step}", base, base + 12 * MS, track="main")
        # backward 7 ms less its 4 ms wait
        assert rec.last_step_phases() == {"forward": 2 * MS, "backward": 3 * MS, "optimizer": 1 * MS}, mode
        numbers = ComputePhases(world_size=2).numbers(1, rec)
        assert numbers == pytest.approx([0.0, 0.0, 0.0, 2.0, 3.0, 1.0]), mode
