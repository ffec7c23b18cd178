"""The trace of a TensorParallelStrategy (issue 42, item 5): 2 worker processes on 127.0.0.1 under `stratagem launch`,
an MLP whose first Linear is split by output features and second by input features. Every collective DTensor issues
and every sum of the data axis is in the trace, with the bytes worked out by hand; the merged file passes the checks
Perfetto relies on, the step table adds up, and a worker sleeping 50 ms inside its backward is named as late, in
backward, as for the other strategies."""

from __future__ import annotations

import collections

import pytest
from helpers import launch_json_workers

from stratagem.trace.merge import chrome_trace, load
from stratagem.trace.summary import summarize
from stratagem.trace.validate import problems

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]

# Linear(16, 32) and Linear(32, 4), float32, a global batch of 8. On one `model` axis of 2 workers, the second layer's
# partial sums are all-reduced into the whole output, (8, 4), once per step: 128 bytes. On a ("data", "model") mesh of
# shape (2, 1) nothing is split; each gradient is summed across the data axis once per step, each its own bytes.
MODEL_AXIS = {("all_reduce", "all-reduce (model axis)", 8 * 4 * 4): 1}
DATA_AXIS = {("all_reduce", "all-reduce (data axis)", n * 4): 1 for n in (32 * 16, 32, 4 * 32, 4)}
CHECK = ("all_reduce", "batch agreement", 224)  # each step's batch check, and the agreement on the steps once
AGREEMENT = ("all_reduce", "agreement on the number of steps", 16)


# On the `model` axis, 12 steps traced with `strategy.trace(DIR)`, worker 1 sleeping 50 ms in its backward at each;
# on the `data` axis, 4 steps traced for the whole run, as `stratagem launch --trace DIR` does it (STRATAGEM_TRACE).
@pytest.mark.parametrize(
    ("mesh", "per_step", "steps", "how"),
    [("model", MODEL_AXIS, 12, "TR_DIR"), ("data", DATA_AXIS, 4, "STRATAGEM_TRACE")],
)
def test_every_collective_of_a_step_is_traced_with_its_bytes_and_the_late_worker_named(
    tmp_path, mesh, per_step, steps, how
):
    settings = {how: tmp_path, "TR_MESH": mesh, "TR_STEPS": steps}
    if mesh == "model":
        settings.update(TR_SLOW_RANK=1, TR_SLOW_MS=50)
    code, _, lines = launch_json_workers("trace_tensor_parallel.py", settings, timeout=150)
    assert code == 0, "\n".join(lines[-30:])
    job = load(tmp_path)
    assert [w.task for w in job.workers] == ["worker:0", "worker:1"]
    for worker in job.workers:
        counts = collections.Counter((c.op, c.what, c.nbytes) for c in worker.collectives)
        assert counts == {**{k: n * steps for k, n in per_step.items()}, CHECK: steps, AGREEMENT: 1}, counts
        spans = collections.Counter(s.category for s in worker.spans)
        assert [spans[c] for c in ("step", "input", "forward", "backward", "optimizer")] == [steps] * 5, spans
        assert spans["wait"] == len(worker.collectives)  # each one waited for, on the training thread
        backward = [s for s in worker.spans if s.category == "backward"]
        for wait in (s for s in worker.spans if s.category == "wait" and "data axis" in s.name):
            assert any(b.start <= wait.start <= wait.end <= b.end for b in backward), wait  # the sum is in backward
    document = chrome_trace(job)
    assert problems(document) == []
    flows = [e for e in document["traceEvents"] if e["ph"] in ("s", "f")]
    assert len(flows) == 2 * len(job.workers[0].collectives)  # one arrow per collective, first to last to arrive
    report = summarize(job)
    assert len(report.rows) == 2 * steps
    for row in report.rows:
        assert row.parts_ms == pytest.approx(row.step_ms, rel=0.02), row
    if mesh == "model":  # worker 1 arrives last at each step's batch check, having slept in backward
        assert [(w.task, w.phase, w.step) for w in report.named] == [("worker:1", "backward", 10)], report.text()
        peers = [r.peers_ms for r in report.rows if r.task == "worker:0" and r.step > 1]
        assert min(peers) >= 40, peers  # worker 0 waits for it at every step
