"""The trace of a ShardedStrategy (issue 42, item 5): 2 worker processes on 127.0.0.1 under `stratagem launch`, an
MLP of three Linear units, 6 steps in `strategy.trace(DIR)` or a whole run under STRATAGEM_TRACE. Each unit's all-gather and reduce-scatter is a
collective named by the unit, with the bytes worked out by hand, as often as the stage makes them; the merged
file passes the checks Perfetto relies on and the step table adds up."""

from __future__ import annotations

import collections

import pytest
from helpers import launch_json_workers

from stratagem.trace.merge import chrome_trace, load
from stratagem.trace.summary import summarize
from stratagem.trace.validate import problems

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]

STEPS = 6
# Linear(16, 32), Linear(32, 32), Linear(32, 4) at positions 0, 2, 4 of the Sequential, float32, 2 ranks: each
# rank's shard is half of every weight's rows and half of every bias (no padding: 32 and 4 rows divide by 2);
# the reduce-scatter takes the rank's whole flat gradient.
SHARD_BYTES = {"0": (16 * 16 + 16) * 4, "2": (16 * 32 + 16) * 4, "4": (2 * 32 + 2) * 4}
GRADIENT_BYTES = {"0": (32 * 16 + 32) * 4, "2": (32 * 32 + 32) * 4, "4": (4 * 32 + 4) * 4}


# Stage 3 traced with `strategy.trace(DIR)`; stage 2 for the whole run, as `stratagem launch --trace DIR` does it
# (STRATAGEM_TRACE), each worker writing its file at exit.
@pytest.mark.parametrize(("stage", "gathers", "how"), [(3, 2, "TR_DIR"), (2, 1, "STRATAGEM_TRACE")])
def test_each_units_all_gather_and_reduce_scatter_is_traced_as_often_as_the_stage_makes_them(
    tmp_path, stage, gathers, how
):
    code, _, lines = launch_json_workers(
        "trace_sharded.py", {how: tmp_path, "TR_STAGE": stage, "TR_STEPS": STEPS}, timeout=150
    )
    assert code == 0, "\n".join(lines[-30:])
    job = load(tmp_path)
    assert [w.task for w in job.workers] == ["worker:0", "worker:1"]
    for worker in job.workers:
        counts = collections.Counter((c.op, c.what, c.nbytes) for c in worker.collectives)
        for unit in SHARD_BYTES:
            # Stage 3 gathers a unit for its forward and again for its backward; stage 2 keeps it in between.
            assert counts[("all_gather", f"all-gather of {unit}", SHARD_BYTES[unit])] == gathers * STEPS, counts
            assert counts[("reduce_scatter", f"reduce-scatter of {unit}", GRADIENT_BYTES[unit])] == STEPS, counts
        spans = collections.Counter(s.category for s in worker.spans)
        assert [spans[c] for c in ("step", "input", "forward", "backward", "optimizer")] == [STEPS] * 5, spans
        assert spans["wait"] == len(worker.collectives)  # every one summed through shared memory, waited in
    document = chrome_trace(job)
    assert problems(document) == []
    flows = [e for e in document["traceEvents"] if e["ph"] in ("s", "f")]
    assert len(flows) == 2 * len(job.workers[0].collectives)  # one arrow per collective, first to last to arrive
    report = summarize(job)
    assert len(report.rows) == 2 * STEPS
    for row in report.rows:
        assert row.parts_ms == pytest.approx(row.step_ms, rel=0.02), row
        assert row.peers_ms + row.transfer_ms > 0, row
