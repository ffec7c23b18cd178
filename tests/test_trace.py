"""The trace's pieces on hand-made data: the recorder, the clock offset, the breakdown of a step, the late
worker, the merged file and its checks (issue 42). No process group; the multi-process runs are in
tests/test_trace_multi_worker.py."""

from __future__ import annotations

import gzip
import json
import threading
import time

import pytest

from stratagem.errors import InputError
from stratagem.trace import Recorder
from stratagem.trace.clocks import align
from stratagem.trace.late import LateStep, name_late_workers
from stratagem.trace.merge import chrome_trace, load, merge
from stratagem.trace.summary import summarize
from stratagem.trace.validate import problems

MS = 1_000_000


def _worker(rank: int, *, arrive_ms: float, shift_ms: float) -> dict:
    """One step: input [0, 1], the step [1, 10] with forward [1, 2], backward [3, 9] holding the wait for the
    gradient sum [arrive, 8], optimizer [9, 9.5] (chief's ms); written on a clock `shift_ms` ahead of the chief's."""
    rec = Recorder(rank=rank, task=f"worker:{rank}", world_size=2)
    s = int(shift_ms * MS)

    def at(ms: float) -> int:
        return int(ms * MS) + s

    rec.at_step(1)
    rec.span("input", "input 0", at(0), at(1), track="main")
    rec.span("step", "step 1", at(1), at(10), track="main")
    rec.span("forward", "forward", at(1), at(2), track="main")
    rec.span("backward", "backward", at(3), at(9), track="main")
    rec.collectives.append([0, "all_reduce", "gradient all-reduce", 1, 64, 0, "gloo", at(arrive_ms), at(8)])
    rec.span("wait", "gradient all-reduce", at(arrive_ms), at(8), track="main", args={"seqs": [0]})
    rec.span("optimizer", "optimizer step", at(9), at(9.5), track="main")
    rec.clock_offset = {"offset_ns": -s, "error_ns": 20_000, "samples": 16}
    return rec.to_dict()


@pytest.fixture
def two_workers(tmp_path):
    (tmp_path / "worker-0.json").write_text(json.dumps(_worker(0, arrive_ms=4, shift_ms=0)))
    (tmp_path / "worker-1.json").write_text(json.dumps(_worker(1, arrive_ms=6, shift_ms=1)))
    return tmp_path


def test_a_step_is_cut_into_input_compute_waiting_transfer_and_idle_that_add_up(two_workers):
    report = summarize(load(two_workers))
    rows = {r.task: r for r in report.rows}
    # worker:0 arrived at 4 ms, worker:1 (the last) at 6: 2 ms of waiting, then 2 ms of transfer for both.
    w0, w1 = rows["worker:0"], rows["worker:1"]
    assert (w0.step_ms, w0.input_ms, w0.peers_ms, w0.transfer_ms, w0.idle_ms) == (10, 1, 2, 2, 0)
    # compute: forward 1 + backward 6 less its 4 ms wait + optimizer 0.5 + the rest of the step 1.5
    assert (w0.compute_ms, w0.backward_ms) == (5, 2)
    assert (w1.compute_ms, w1.backward_ms, w1.peers_ms, w1.transfer_ms) == (7, 4, 0, 2)
    for row in report.rows:
        assert row.parts_ms == pytest.approx(row.step_ms, rel=0.02)
    # worker:1 spent 2 ms more in backward before the sum: the others waited 2 ms for it.
    assert [(s.task, s.margin_ms, s.phase) for s in report.late_steps] == [("worker:1", 2.0, "backward")]
    assert report.clocks["worker:1"] == {"offset_ms": -1.0, "error_ms": 0.02}


def test_the_merged_file_is_one_process_per_worker_with_flows_that_pair_up(two_workers):
    path = merge(two_workers)
    document = json.loads(gzip.decompress(path.read_bytes()))
    assert problems(document) == []
    names = {e["pid"]: e["args"]["name"] for e in document["traceEvents"] if e.get("name") == "process_name"}
    assert names == {0: "worker:0", 1: "worker:1"}
    flow = sorted((e["ph"], e["pid"]) for e in document["traceEvents"] if e["ph"] in "stf")
    assert flow == [("f", 1), ("s", 0)]  # the arrow ends at the worker that arrived last
    spans = [e for e in document["traceEvents"] if e["ph"] == "X" and e["name"] == "forward"]
    assert sorted(e["ts"] for e in spans) == [1000.0, 1000.0]  # worker:1's clock, 1 ms ahead, put back


def test_the_checks_find_a_missing_field_spans_that_cross_and_a_flow_without_its_end():
    document = {
        "traceEvents": [
            {"ph": "X", "name": "a", "pid": 0, "tid": 1, "ts": 0, "dur": 10},
            {"ph": "X", "name": "b", "pid": 0, "tid": 1, "ts": 5, "dur": 10},
            {"ph": "X", "name": "c", "pid": 0, "ts": 0, "dur": 1},
            {"ph": "s", "id": 7, "pid": 0, "tid": 1, "ts": 0},
        ]
    }
    assert problems(document) == [
        "complete event 'c' lacks ['tid']",
        "pid 0 tid 1: 'b' [5, 15] overlaps the end of 'a' (10) without nesting in it",
        "flow 7: 1 start(s) and 0 finish(es), not one of each",
    ]


def test_an_empty_directory_is_refused_with_the_fix(tmp_path):
    with pytest.raises(InputError, match="No worker trace files in the directory. Received: '.*'. Give the directory"):
        load(tmp_path)
    (tmp_path / "worker-0.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(InputError, match="is not a stratagem worker trace. Received: format='other'"):
        load(tmp_path)


def test_a_late_worker_is_named_once_it_is_last_in_most_of_a_window_and_jitter_names_no_one():
    late = [LateStep(s, "worker:1", 1, 50.0, "backward") for s in range(1, 21)]
    named = name_late_workers(late, {s: 60.0 for s in range(1, 21)})
    assert [(w.task, w.phase, w.step, w.share) for w in named] == [("worker:1", "backward", 10, 1.0)]
    assert "worker:1 (rank 1) arrived last at 100% of the steps up to step 10, 50.0 ms" in named[0].describe()
    # Who arrives last alternates, by little: nobody.
    jitter = [LateStep(s, f"worker:{s % 2}", s % 2, 0.4, "forward") for s in range(1, 501)]
    assert name_late_workers(jitter, {s: 3.0 for s in range(1, 501)}) == []
    # Always the same worker, but by less than 5 ms: nobody either.
    small = [LateStep(s, "worker:0", 0, 1.0, "input") for s in range(1, 101)]
    assert name_late_workers(small, {s: 3.0 for s in range(1, 101)}) == []


class _Store:
    """A dict with torch.distributed's store calls (set, get blocking until set, wait), shared by threads."""

    def __init__(self) -> None:
        self._values: dict[str, str] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: str) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()

    def wait(self, keys, timeout) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: all(k in self._values for k in keys), timeout.total_seconds()):
                raise TimeoutError(keys)

    def get(self, key: str) -> bytes:
        self.wait([key], __import__("datetime").timedelta(seconds=10))
        return self._values[key].encode()


def test_a_clock_50_ms_ahead_is_measured_within_a_millisecond():
    store = _Store()
    results: dict[int, object] = {}

    def rank(r: int, shift_ns: int) -> None:
        results[r] = align(store, rank=r, world_size=2, clock=lambda: time.perf_counter_ns() + shift_ns, round_id="a")

    threads = [threading.Thread(target=rank, args=(0, 0)), threading.Thread(target=rank, args=(1, 50 * MS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    chief, worker = results[0], results[1]
    assert (chief.offset_ns, chief.error_ns) == (0, 0)
    assert abs(worker.offset_ns + 50 * MS) <= MS and worker.error_ns < MS
    assert abs(worker.offset_ns + 50 * MS) <= worker.error_ns + 1  # the bound holds


def test_a_recorder_that_is_off_records_nothing_and_an_unknown_thread_keeps_its_name():
    rec = Recorder(rank=0, task="worker:0")
    assert not rec.on
    rec.start(clock=lambda: 5)
    seq = rec.collective("all_reduce", "loss", 1, 8, "gloo")
    rec.done(seq, at=9)
    rec.done(seq, at=11)  # the first report counts
    assert rec.collectives == [[0, "all_reduce", "loss", 1, 8, None, "gloo", 5, 9]]
    names = []
    thread = threading.Thread(target=lambda: names.append(rec.track()), name="loader")
    thread.start()
    thread.join()
    assert (rec.track(), names) == ("main", ["loader"])
    assert chrome_trace(load_dict(rec))["traceEvents"][0]["args"] == {"name": "worker:0"}


def load_dict(rec: Recorder):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        rec.write(d)
        return load(d)
