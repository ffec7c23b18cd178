"""`sg.fit(..., trace=DIR)` and `stratagem train --trace DIR` (issue 42, item 1): 2 MultiWorkerMirrored worker
processes on 127.0.0.1 trace their fit into one merged file that passes the checks Perfetto relies on; a strategy
that records no trace is refused before any work, in fit and on the command line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import launch_json_workers
from torch import nn

import stratagem as sg
from stratagem.cli.main import main
from stratagem.trace.merge import load
from stratagem.trace.summary import summarize
from stratagem.trace.validate import problems

pytestmark = pytest.mark.timeout(200)


def _merged(directory: Path) -> dict:
    return json.loads(gzip.decompress((directory / "trace.json.gz").read_bytes()))


@pytest.mark.multiprocess
def test_fit_with_trace_on_2_workers_writes_one_valid_merged_file_of_every_step_and_then_leaves_a_sample_on(tmp_path):
    code, outcomes, lines = launch_json_workers(
        "trace_fit.py", {"TR_DIR": tmp_path, "TR_STEPS": 6, "TR_EPOCHS": 2}, timeout=150
    )
    assert code == 0, "\n".join(lines[-30:])
    assert sorted(outcomes) == [0, 1]
    # The chief merged the files inside fit, after both workers had written theirs.
    document = _merged(tmp_path)
    assert problems(document) == []
    events = document["traceEvents"]
    assert {e["args"]["name"] for e in events if e.get("name") == "process_name"} == {"worker:0", "worker:1"}
    assert {"step", "forward", "backward", "optimizer", "wait", "collective"} <= {e.get("cat") for e in events}
    for pid in {e["pid"] for e in events if e["ph"] == "X"}:
        steps = [e for e in events if e["ph"] == "X" and e["pid"] == pid and e["cat"] == "step"]
        assert len(steps) == 12, [e["name"] for e in steps]  # 2 epochs of 6 batches, on each worker
    report = summarize(load(tmp_path))
    assert len({r.step for r in report.rows}) == 12
    for row in report.rows:
        assert row.parts_ms == pytest.approx(row.step_ms, rel=0.02), row
    assert report.named == [], report.late_steps
    # The epoch after, with fit's default trace: each worker's own table of a sample of its 6 steps, in memory.
    for rank, outcome in outcomes.items():
        left_on = outcome["left_on"]
        assert left_on is not None and left_on["num_steps"] == 6 and 1 <= left_on["num_recorded"] <= 6, outcome
        assert left_on["tasks"] == [f"worker:{rank}"] * left_on["num_recorded"] and left_on["adds_up"], outcome
        assert "A trace is recording already" in (outcome["nested"] or ""), outcome
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json.gz", "worker-0.json", "worker-1.json"]


def test_fit_with_trace_on_mirrored_puts_each_replica_thread_on_a_track_of_its_own(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(4)]
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        sg.fit(strategy, net, torch.optim.SGD(net.parameters(), lr=0.01), F.cross_entropy, data, epochs=2,
               trace=tmp_path)  # fmt: skip
    finally:
        strategy.close()
    document = _merged(tmp_path)
    assert problems(document) == []
    events = document["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [(e["cat"], tracks[e["tid"]]) for e in events if e["ph"] == "X"]
    # 2 epochs of 4 batches: each step on the calling thread, each replica's passes on its own thread.
    assert spans.count(("step", "main")) == 8
    for track in ("main", "replica 1"):
        assert spans.count(("forward", track)) == 8, track
        assert spans.count(("backward", track)) == 8, track
    report = summarize(load(tmp_path))
    assert [r.task for r in report.rows] == ["worker:0"] * 8
    for row in report.rows:
        assert row.parts_ms == pytest.approx(row.step_ms, rel=0.02), row


def test_each_backup_save_is_a_span_of_the_trace(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 4))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(3)]
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
    backup = sg.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=2, delete_checkpoint=False)
    try:
        sg.fit(strategy, net, torch.optim.SGD(net.parameters(), lr=0.01), F.cross_entropy, data, epochs=2,
               callbacks=[backup], trace=tmp_path / "trace")  # fmt: skip
    finally:
        strategy.close()
    document = _merged(tmp_path / "trace")
    assert problems(document) == []
    saves = [e for e in document["traceEvents"] if e["ph"] == "X" and e["cat"] == "backup"]
    # Every other of the 6 steps, on the training thread, between the steps (no step span contains one).
    assert [e["name"] for e in saves] == ["backup of step 2", "backup of step 4", "backup of step 6"], saves
    steps = [e for e in document["traceEvents"] if e["ph"] == "X" and e["cat"] == "step"]
    for save in saves:
        assert not any(s["ts"] < save["ts"] < s["ts"] + s["dur"] for s in steps), save


def test_fit_refuses_a_trace_of_a_strategy_that_records_none_before_any_work(tmp_path):
    net = nn.Linear(4, 2)
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]
    strategy = sg.OneDeviceStrategy("cpu:0")
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(sg.InputError, match=r"OneDeviceStrategy does not record traces yet\. Received: trace="):
        sg.fit(strategy, net, optimizer, F.cross_entropy, data, trace=tmp_path / "traces")
    with pytest.raises(sg.InputError, match=r"trace must name a directory, or be True or False\. Received: trace=5\."):
        sg.fit(strategy, net, optimizer, F.cross_entropy, data, trace=5)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters())), "trained before the refusal"
    assert not (tmp_path / "traces").exists()


def test_stratagem_train_refuses_trace_with_a_strategy_that_records_none(capsys, tmp_path):
    assert main(["train", "--strategy", "one_device", "--trace", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--strategy one_device does not record traces yet. Received: --strategy one_device --trace" in err
    assert "Use --strategy mirrored or multi_worker" in err


@pytest.mark.multiprocess
def test_stratagem_train_trace_on_2_workers_writes_a_valid_merged_file(capsys, tmp_path):
    code = main(["train", "--strategy", "multi_worker", "--workers", "2", "--epochs", "1", "--json",
                 "--trace", str(tmp_path)])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    assert json.loads(captured.out)["config"]["trace"] == str(tmp_path)  # stdout is the JSON alone
    assert f"trace written to {tmp_path / 'trace.json.gz'}" in captured.err
    document = _merged(tmp_path)
    assert problems(document) == []
    names = {e["args"]["name"] for e in document["traceEvents"] if e.get("name") == "process_name"}
    assert names == {"worker:0", "worker:1"}
    # 1437 training images in global batches of 256: 6 steps, and the 360 test images' evaluation after fit.
    steps = {(e["pid"], e["name"]) for e in document["traceEvents"] if e["ph"] == "X" and e["cat"] == "step"}
    assert len(steps) == 2 * 6, sorted(steps)


def test_stratagem_train_trace_on_its_default_mirrored_strategy_writes_both_replicas_tracks(capsys, tmp_path):
    code = main(["train", "--devices", "cpu:0,cpu:1", "--epochs", "1", "--json", "--trace", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    assert f"trace written to {tmp_path / 'trace.json.gz'}" in captured.err
    document = _merged(tmp_path)
    assert problems(document) == []
    tracks = {e["args"]["name"] for e in document["traceEvents"] if e.get("name") == "thread_name"}
    assert {"main", "replica 1"} <= tracks, tracks
