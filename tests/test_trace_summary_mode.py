"""A trace in summary mode (issue 42, item 6): each step's spans folded as the step ends. On hand-made steps it
gives the table and the late worker that full mode gives from every span, in fewer bytes; a bad mode is refused.
No process group; tests/test_trace_multi_worker.py runs it on real workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stratagem.errors import InputError
from stratagem.trace import Recorder
from stratagem.trace.merge import load, merge
from stratagem.trace.summary import summarize
from stratagem.trace.validate import problems

MS = 1_000_000
STEPS = 12


def _record(rank: int, mode: str, *, arrive_ms: float) -> dict:
    """STEPS steps of 20 ms, recorded in the order a worker records them: input [0, 1], forward [1, 2],
    backward [3, 15] holding the wait for the gradient sum [arrive, 14], optimizer [15, 15.5], and the whole
    `strategy.run` [1, 16] last, at its end (ms after the step's start, on the chief's clock)."""
    rec = Recorder(rank=rank, task=f"worker:{rank}", world_size=2)
    rec.start(mode=mode)
    for step in range(1, STEPS + 1):
        base = step * 20.0

        def at(ms: float, base: float = base) -> int:
            return int((base + ms) * MS)

        rec.span("input", f"input {step}", at(0), at(1), track="main")
        rec.at_step(step)
        rec.span("forward", "forward", at(1), at(2), track="main")
        seq = len(rec.collectives)
        rec.collectives.append([seq, "all_reduce", "gradients", step, 64, 0, "gloo", at(arrive_ms), at(14)])
        rec.span("wait", "gradients", at(arrive_ms), at(14), track="main", args={"seqs": [seq]})
        rec.span("backward", "backward", at(3), at(15), track="main")
        rec.span("optimizer", "optimizer step", at(15), at(15.5), track="main")
        rec.span("step", f"step {step}", at(1), at(16), track="main")
    rec.stop()
    return rec.to_dict()


def _job(directory: Path, mode: str) -> Path:
    directory.mkdir()
    for rank, arrive in ((0, 4.0), (1, 10.0)):  # worker:1 enters every gradient sum 6 ms after worker:0
        (directory / f"worker-{rank}.json").write_text(json.dumps(_record(rank, mode, arrive_ms=arrive)))
    return directory


def test_summary_mode_gives_the_table_and_late_worker_of_full_mode_in_fewer_bytes(tmp_path):
    full = summarize(load(_job(tmp_path / "spans", "spans")))
    folded_dir = _job(tmp_path / "summary", "summary")
    folded = summarize(load(folded_dir))
    assert folded.rows == full.rows
    assert folded.late_steps == full.late_steps
    assert folded.named == full.named
    # Worked out by hand: worker:0 waits 4 -> 10 ms for worker:1, then both move the data 10 -> 14.
    rows = {(r.step, r.task): r for r in folded.rows}
    w0, w1 = rows[(5, "worker:0")], rows[(5, "worker:1")]
    assert (w0.step_ms, w0.input_ms, w0.peers_ms, w0.transfer_ms, w0.idle_ms) == (20, 1, 6, 4, 4)
    assert (w1.peers_ms, w1.transfer_ms, w1.backward_ms) == (0, 4, 8)
    assert [(w.task, w.phase, w.step) for w in folded.named] == [("worker:1", "backward", 10)]
    # The folded file keeps no span, and is smaller.
    raw = json.loads((folded_dir / "worker-0.json").read_text())
    assert raw["mode"] == "summary" and raw["spans"] == [] and len(raw["steps"]) == STEPS
    sizes = {mode: (tmp_path / mode / "worker-0.json").stat().st_size for mode in ("spans", "summary")}
    assert sizes["summary"] < 0.75 * sizes["spans"], sizes
    document = json.loads(__import__("gzip").decompress(merge(folded_dir).read_bytes()))
    assert problems(document) == []


def test_a_job_traced_in_two_modes_is_refused(tmp_path):
    directory = _job(tmp_path / "mixed", "summary")
    (directory / "worker-1.json").write_text(json.dumps(_record(1, "spans", arrive_ms=10.0)))
    with pytest.raises(InputError, match=r"traced in different modes\. Received: spans, summary\."):
        summarize(load(directory))


def test_an_unknown_trace_mode_is_refused():
    with pytest.raises(InputError, match=r"A trace's mode is one of 'spans', 'summary'\. Received: mode='steps'\."):
        Recorder(rank=0, task="worker:0").start(mode="steps")
