"""The trace of real MultiWorkerMirrored jobs (issue 42): 2 worker processes on 127.0.0.1 under `stratagem
launch`, a tiny MLP, 30 steps. A +50 ms sleep inside worker 1's backward pass (not its forward), or inside its
data loading, is named with its phase within 20 steps; clean steps name no one; a worker whose trace clock runs
50 ms ahead is put back within 1 ms; the merged file passes the checks Perfetto relies on."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import WORKERS, launch_json_workers

from stratagem.trace.merge import load
from stratagem.trace.summary import summarize
from stratagem.trace.validate import problems

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]


def _traced(tmp_path: Path, **settings) -> tuple[object, list[str]]:
    code, _, lines = launch_json_workers("trace_train.py", {"STRATAGEM_TRACE": tmp_path, **settings}, timeout=150)
    assert code == 0, "\n".join(lines[-30:])
    return summarize(load(tmp_path)), lines


def test_stratagem_launch_trace_names_a_sleep_in_worker_1s_backward_and_writes_a_valid_merged_file(tmp_path):
    env = {"TR_SLOW_RANK": "1", "TR_SLOW_MS": "50", "TR_PHASE": "backward", "TR_STEPS": "30"}
    command = [sys.executable, "-m", "stratagem", "launch", "--workers", "2", "--trace", str(tmp_path),
               str(WORKERS / "trace_train.py")]  # fmt: skip
    done = subprocess.run(command, env={**__import__("os").environ, **env}, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"trace written to {tmp_path / 'trace.json.gz'}" in done.stderr
    # The straggler warning, refined by the trace: the phase of compute worker 1 is slow in.
    assert "worker:1 (rank 1) is a straggler at step" in done.stderr, done.stderr[-3000:]
    assert "slower than its peers in compute (backward, by the trace)" in done.stderr, done.stderr[-3000:]
    document = json.loads(gzip.decompress((tmp_path / "trace.json.gz").read_bytes()))
    assert problems(document) == []
    events = document["traceEvents"]
    assert {e["args"]["name"] for e in events if e.get("name") == "process_name"} == {"worker:0", "worker:1"}
    tracks = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"main", "transport: shared memory"} <= tracks, tracks
    assert {"input", "forward", "backward", "optimizer", "wait", "collective"} <= {e.get("cat") for e in events}
    buckets = [e for e in events if e["ph"] == "X" and e["cat"] == "collective" and "bucket" in e["args"]]
    assert buckets and all(e["args"]["bytes"] > 0 and e["args"]["op"] == "all_reduce" for e in buckets)

    summary = subprocess.run(
        [sys.executable, "-m", "stratagem", "trace", "summary", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert summary.returncode == 0, summary.stderr
    report = json.loads(summary.stdout)
    named = report["named"]
    assert [(w["task"], w["phase"]) for w in named] == [("worker:1", "backward")], report["late_steps"]
    assert named[0]["step"] <= 20 and named[0]["margin_ms"] >= 40
    for row in report["rows"]:
        parts = sum(row[k] for k in ("input_ms", "compute_ms", "peers_ms", "transfer_ms", "idle_ms"))
        assert parts == pytest.approx(row["step_ms"], rel=0.02), row
    # worker:0 waits for worker:1 at each gradient sum; worker:1's backward holds the 50 ms.
    means = report["means"]
    assert means["worker:0"]["peers_ms"] >= 40 and means["worker:1"]["peers_ms"] < 10, means
    assert Path(report["png"]).stat().st_size > 10_000


def test_a_sleep_in_worker_1s_data_loading_is_named_as_input(tmp_path):
    report, _ = _traced(tmp_path, TR_SLOW_RANK=1, TR_SLOW_MS=50, TR_PHASE="input", TR_STEPS=30)
    assert [(w.task, w.phase) for w in report.named] == [("worker:1", "input")], report.late_steps
    assert report.named[0].step <= 20


def test_clean_steps_name_no_one_and_a_clock_50_ms_ahead_is_put_back_within_1_ms(tmp_path):
    code, _, lines = launch_json_workers(
        "trace_train.py", {"TR_DIR": tmp_path, "TR_SHIFT_RANK": 1, "TR_SHIFT_MS": 50, "TR_STEPS": 40}, timeout=150
    )
    assert code == 0, "\n".join(lines[-30:])
    job = load(tmp_path)
    worker = job.workers[1]
    assert abs(worker.offset_ns + 50_000_000) <= 1_000_000, worker.offset_ns
    assert worker.error_ns <= 1_000_000
    # After the shift is taken out, the end of each sum (which every worker leaves together) lines up.
    ends = {c.seq: c.done for c in job.workers[0].collectives}
    gaps = sorted(abs(c.done - ends[c.seq]) for c in worker.collectives if c.done is not None and ends.get(c.seq))
    assert gaps and gaps[len(gaps) // 2] < 1_000_000, gaps[:10]
    report = summarize(job)
    assert report.named == [], report.late_steps
    assert len({r.step for r in report.rows}) == 40


def test_summary_mode_names_the_sleep_in_backward_from_the_folded_steps_alone(tmp_path):
    code, _, lines = launch_json_workers(
        "trace_train.py",
        {"TR_DIR": tmp_path, "TR_MODE": "summary", "TR_SLOW_RANK": 1, "TR_SLOW_MS": 50, "TR_STEPS": 30},
        timeout=150,
    )
    assert code == 0, "\n".join(lines[-30:])
    job = load(tmp_path)
    assert all(w.mode == "summary" and w.spans == [] and len(w.steps) == 30 for w in job.workers)
    report = summarize(job)
    assert [(w.task, w.phase) for w in report.named] == [("worker:1", "backward")], report.late_steps
    assert report.named[0].step <= 20
    for row in report.rows:
        assert row.parts_ms == pytest.approx(row.step_ms, rel=0.02), row
    means = report.means()
    assert means["worker:0"]["peers_ms"] >= 40 and means["worker:1"]["peers_ms"] < 10, means


@pytest.mark.parametrize(("slow", "phase"), [(2, "backward"), (1, "input")])
def test_at_3_workers_a_sleep_in_one_workers_backward_or_data_loading_is_named_within_20_steps(tmp_path, slow, phase):
    code, outcomes, lines = launch_json_workers(
        "trace_train.py",
        {"TR_DIR": tmp_path, "TR_SLOW_RANK": slow, "TR_SLOW_MS": 50, "TR_PHASE": phase, "TR_STEPS": 25},
        timeout=150,
        workers=3,
    )
    assert code == 0, "\n".join(lines[-30:])
    assert sorted(outcomes) == [0, 1, 2]
    report = summarize(load(tmp_path))
    late = f"worker:{slow}"
    assert [(w.task, w.phase) for w in report.named] == [(late, phase)], report.late_steps
    assert report.named[0].step <= 20 and report.named[0].margin_ms >= 40, report.named
    means = report.means()
    if phase == "backward":  # both peers wait for the late worker at the gradient sums; it waits for no one
        assert all(means[f"worker:{r}"]["peers_ms"] >= 40 for r in (0, 1)) and means[late]["peers_ms"] < 10, means
    else:  # its own loader is slow, the others' are not
        assert means[late]["input_ms"] >= 40 and means["worker:0"]["input_ms"] < 10, means
