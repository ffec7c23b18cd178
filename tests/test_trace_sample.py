"""Summary mode left on (issue 42, item 6): a sample of the steps, at a rate set by the recorded steps' length, is
recorded exactly as a trace of every step records them; `fit` and `stratagem train` leave it on, `trace=False` and
`--no-trace` turn it off. The rule is driven by a fake clock: nothing here is timed."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from stratagem.cli.main import main
from stratagem.collective.trace_hooks import CollectiveTrace
from stratagem.errors import InputError
from stratagem.strategies.multi_worker.straggler_phases import ComputePhases
from stratagem.strategies.sharded.traced_comms import UnitComms
from stratagem.strategies.sharded.tracing import ShardedTrace
from stratagem.trace import Recorder
from stratagem.trace.merge import JobTrace, load
from stratagem.trace.sample import MAX_EVERY, StepSample, sample_every
from stratagem.trace.summary import summarize
from stratagem.trace.timeline import PHASES

MS = 1_000_000


def test_the_interval_is_the_least_power_of_two_that_keeps_the_cost_within_the_budget():
    # 100 us a recorded step, 1% of the step: 10 ms and more every step; 0.6 ms 1 in 32 (100 / 32 <= 6 < 100 / 16).
    assert [sample_every(w) for w in (10 * MS, 6 * MS, 5 * MS, 3 * MS, 600_000, 550_000)] == [1, 2, 2, 4, 32, 32]
    assert [sample_every(w, cost_ns=60_000) for w in (6 * MS, 5 * MS, 600_000)] == [1, 2, 16]
    assert sample_every(100_000, cost_ns=1_000, budget=0.01) == 1
    assert sample_every(0) == sample_every(1) == MAX_EVERY


def test_after_each_recorded_step_the_next_is_chosen_from_its_window():
    sample = StepSample(start=0, cost_ns=60_000, budget=0.01)
    recorded, now, on = [], 0, True
    for step in range(1, 60):
        if on:
            recorded.append(step)
        now += 20 * MS if step < 3 else 600_000  # two slow first steps, then 0.6 ms ones
        on = sample.next_records(step, recorded=on, now=now)
    assert recorded == [1, 2, 3, 16, 32, 48]  # multiples of the interval: other workers' samples nest in it
    assert (sample.num_steps, sample.num_recorded, sample.every) == (59, 6, 16)


def test_a_step_that_waits_is_measured_by_its_cpu_time():
    sample = StepSample(start=0, cpu_start=0, cost_ns=60_000, budget=0.01)
    # 2.4 ms of wall time, of which 0.6 ms on the training thread's CPU: 1 in 16, as for a 0.6 ms step.
    assert not sample.next_records(1, recorded=True, now=2_400_000, cpu_now=600_000)
    assert sample.every == 16
    sample = StepSample(start=0, cpu_start=0, cost_ns=60_000, budget=0.01)
    assert not sample.next_records(1, recorded=True, now=2_400_000, cpu_now=0)  # CPU unknown: the wall time
    assert sample.every == 4


def test_a_long_run_records_ever_fewer_steps_so_its_memory_stays_bounded():
    sample = StepSample(start=0, cost_ns=60_000, budget=0.01, keep=3)  # 10 ms steps: every step, but for `keep`
    recorded, now, on = [], 0, True
    for step in range(1, 30):
        if on:
            recorded.append(step)
        now += 10 * MS
        on = sample.next_records(step, recorded=on, now=now)
    assert recorded == [1, 2, 3, 4, 6, 8, 12, 16, 20, 24]


def _replay(sampled: bool, steps: int = 13) -> Recorder:
    """`steps` steps of 20 ms through a recorder in summary mode as MirroredStrategy drives it: input [0, 1] before
    the step, forward [1, 2], backward [3, 15] holding the wait for the gradient sum [8, 14], optimizer [15, 15.5],
    the step [1, 16]; `after_step` at its end (the clock then reads the step's end). Sampled: a recorded step costs
    0.6 ms against a budget of 1% of its 16-20 ms window, so 1 step in 4 is recorded."""
    clock = [20 * MS]
    rec = Recorder(rank=0, task="worker:0")
    rec.start(clock=lambda: clock[0], mode="summary")
    if sampled:
        rec.sample_steps(cpu_clock=lambda: clock[0], cost_ns=600_000, budget=0.01)  # all CPU
    for step in range(1, steps + 1):

        def at(ms: float, base: float = step * 20.0) -> int:
            return int((base + ms) * MS)

        if rec.on:
            rec.span("input", "input", at(0), at(1))
            rec.at_step(step)
            rec.span("forward", "forward", at(1), at(2))
            seq = len(rec.collectives)
            rec.collectives.append([seq, "all_reduce", "gradients", step, 64, 0, "gloo", at(8), at(14)])
            rec.span("wait", "gradients", at(8), at(14), args={"seqs": [seq]})
            rec.span("backward", "backward", at(3), at(15))
            rec.span("optimizer", "optimizer step", at(15), at(15.5))
            rec.span("step", f"step {step}", at(1), at(16))
        clock[0] = at(16)
        rec.after_step(step)
    return rec


def _table(rec: Recorder, tmp_path, name: str) -> tuple[list, dict]:
    rec.write(tmp_path / name)
    job: JobTrace = load(tmp_path / name)
    return summarize(job).rows, {s.step: s for s in job.workers[0].steps}


def test_a_sampled_steps_row_is_the_row_a_trace_of_every_step_gives_it(tmp_path):
    rows, folded = _table(_replay(sampled=True), tmp_path, "sampled")
    every_rows, every_folded = _table(_replay(sampled=False), tmp_path, "every")
    assert [r.step for r in rows] == [1, 4, 8, 12]
    assert rows == [r for r in every_rows if r.step in (1, 4, 8, 12)]
    # The window of step 4 opens where step 3 (not recorded) ended: 4 ms of idle after it, then its input.
    assert (folded[4].start, folded[4].end) == (every_folded[4].start, every_folded[4].end) == (76 * MS, 96 * MS)
    assert folded[4].totals == every_folded[4].totals
    written = json.loads((tmp_path / "sampled" / "worker-0.json").read_text())
    assert written["sample"] == {"num_steps": 13, "num_recorded": 4, "every": 4, "cost_ns": 600_000, "budget": 0.01}
    # The stretch before a sampled step's collective starts at its window's start (a trace of every step reaches back
    # to the collective of step 3, which was not recorded): 4 ms idle, input 1, forward 1, the rest of the step 1
    # (2 to 3), backward 5 (3 to 8).
    stretches = [dict(zip(PHASES, row[1:])) for row in written["stretches"]]
    every = json.loads((tmp_path / "every" / "worker-0.json").read_text())["stretches"]
    assert stretches[0] == dict(zip(PHASES, every[0][1:]))
    expected = {"input": MS, "forward": MS, "backward": 5 * MS, "optimizer": 0, "compute": MS, "idle": 4 * MS}
    assert stretches[1:] == [expected] * 3


def test_between_samples_the_straggler_warning_gets_the_last_recorded_steps_phases():
    rec = _replay(sampled=True, steps=6)  # recorded: 1 and 4; 5 and 6 were not, nor will 7 be
    assert not rec.on and rec.recording
    assert ComputePhases(world_size=2).numbers(0, rec) == pytest.approx([1.0, 6.0, 0.5, 0.0, 0.0, 0.0])


def test_only_a_trace_in_summary_mode_samples_steps():
    rec = Recorder(rank=0, task="worker:0")
    rec.start(mode="spans")
    with pytest.raises(InputError, match=r"Only a trace in summary mode samples steps\. Received: mode='spans'\."):
        rec.sample_steps()


def test_a_collective_waited_for_in_a_skipped_step_ends_there():
    rec = Recorder(rank=0, task="worker:0")
    rec.start(clock=lambda: 7, mode="summary")
    hooks, work = CollectiveTrace(), object()
    hooks.recorder = rec
    seq = hooks.enter("all_reduce", "end of data", 1, torch.zeros(2), shared=True)
    hooks.issued(seq, work)
    rec.on = False  # the sample skips the step in which the thread waits for it
    hooks.waited(hooks.wait_started(), [work], "end of data")
    assert rec.collectives[0][8] == 7  # done
    rec.clear()  # a later trace: a work handle of the same id must not end another trace's collective
    hooks.waited(None, [work], "end of data")


def test_a_worker_groups_trace_ends_every_step_with_after_step_so_its_steps_are_sampled(tmp_path):
    """ShardedStrategy's trace (TensorParallelStrategy's shares the step hooks) as its `run` drives it: 13 steps of
    20 ms, a recorded step costing 0.6 ms against 1% of it, so 1 step in 4 is recorded, numbered as the run numbers
    them; a trace of a range begun between two recorded steps is refused."""
    clock, steps = [0], [0]
    group = SimpleNamespace(
        rank=0, task_name="worker:0", world_size=1, cross_worker=SimpleNamespace(trace=CollectiveTrace())
    )
    trace = ShardedTrace(group, step=lambda: steps[0], env={})  # type: ignore[arg-type]
    rec = trace.recorder
    rec.start(clock=lambda: clock[0], mode="summary")
    rec.sample_steps(cpu_clock=lambda: clock[0], cost_ns=600_000, budget=0.01)
    recorded = []
    for step in range(1, 14):
        started = trace.step_started()
        if started is not None:
            recorded.append(rec.step)
        clock[0] += 20 * MS
        steps[0] += 1  # the strategy counts the step before it calls step_ended
        trace.step_ended(started)
    assert recorded == [1, 4, 8, 12]
    assert (rec.sample.num_steps, rec.sample.num_recorded, rec.sample.every) == (13, 4, 4)  # type: ignore[union-attr]
    assert [s[0] for s in rec.to_dict()["steps"]] == [1, 4, 8, 12]
    assert not rec.on and rec.recording
    with pytest.raises(InputError, match=r"A trace is recording already .*Received: strategy\.trace\("):
        with trace.trace(tmp_path):
            pass


def test_a_sharded_units_collective_costs_a_flag_read_in_a_step_no_trace_records():
    def step() -> int:
        raise AssertionError("the step was read in a step no trace records")

    hooks = CollectiveTrace()
    hooks.recorder = Recorder(rank=0, task="worker:0")  # off: a step a sampled trace skips
    comms = UnitComms(hooks, "root", step, shared=False)
    ran = []
    assert comms.call("all_gather", torch.zeros(2), lambda: ran.append(1)) is None
    assert ran == [1] and hooks.recorder.collectives == []


def _data() -> list:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(6)]


def test_fit_leaves_summary_mode_on_for_mirrored_and_trace_false_turns_it_off():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        history = sg.fit(strategy, net, torch.optim.SGD(net.parameters(), lr=0.01), F.cross_entropy, _data(), epochs=2)
        trace = history.trace
        assert trace is not None and trace.num_steps == 12 and 1 <= trace.num_recorded <= 12
        recorded = [r.step for r in trace.summary.rows]
        assert recorded[0] == 1 and len(recorded) == trace.num_recorded == trace.to_dict()["num_recorded"]
        for row in trace.summary.rows:
            assert row.parts_ms == pytest.approx(row.step_ms, rel=0.02), row
        assert f"{trace.num_recorded} of 12 steps recorded" in trace.text()
        assert set(trace.means()["worker:0"]) >= {"step_ms", "compute_ms", "communication_ms", "idle_ms"}
        for off in (False, None):
            again = sg.fit(strategy, history.model, history.optimizer, F.cross_entropy, _data(), trace=off)
            assert again.trace is None
    finally:
        strategy.close()


def test_fit_leaves_a_strategy_that_does_not_sample_its_steps_untraced():
    net = nn.Sequential(nn.Linear(16, 4))
    strategy = sg.OneDeviceStrategy("cpu:0")
    history = sg.fit(strategy, net, torch.optim.SGD(net.parameters(), lr=0.01), F.cross_entropy, _data())
    assert history.trace is None


def test_the_trace_left_on_is_written_for_stratagem_trace_summary(tmp_path, capsys):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 4))
    strategy = sg.MirroredStrategy(["cpu:0"])
    try:
        history = sg.fit(strategy, net, torch.optim.SGD(net.parameters(), lr=0.01), F.cross_entropy, _data())
    finally:
        strategy.close()
    assert history.trace is not None
    history.trace.write(tmp_path)
    assert main(["trace", "summary", str(tmp_path), "--json", "--png", "none"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in report["rows"]] == [r.step for r in history.trace.summary.rows]


def test_stratagem_train_reports_the_trace_it_leaves_on_and_no_trace_turns_it_off(capsys):
    assert main(["train", "--epochs", "1", "--json"]) == 0
    trace = json.loads(capsys.readouterr().out)["trace"]
    assert trace["mode"] == "summary" and trace["num_steps"] >= trace["num_recorded"] >= 1
    assert main(["train", "--epochs", "1", "--json", "--no-trace"]) == 0
    assert json.loads(capsys.readouterr().out)["trace"] is None
    with pytest.raises(SystemExit):
        main(["train", "--no-trace", "--trace", "traces/"])
    assert "not allowed with argument" in capsys.readouterr().err
