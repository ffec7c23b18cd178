"""The trace of ModelParallelStrategy's pipeline (issue 42, item 5): each stage's forward and backward of each
micro-batch on the stage's track, and the bubble measured beside GPipe's (S-1)/(M+S-1). Each stage sleeps 10 ms per
micro-batch in forward and again in backward, so every piece of work takes as long, as GPipe's figure assumes, and
the sleeps (no CPU) keep the figure steady on a loaded machine. One process, no process group."""

from __future__ import annotations

import gzip
import json
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from stratagem.trace.merge import load, merge
from stratagem.trace.summary import summarize
from stratagem.trace.validate import problems

pytestmark = pytest.mark.timeout(120)

PAUSE = 0.010
STEPS, STAGES, MICRO = 5, 2, 4


class Sleep(nn.Module):
    """The identity, sleeping PAUSE in its forward and again when its gradient passes back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(PAUSE)
        if x.requires_grad:  # on the input, not the output: the stage's backward starts at its output's gradient
            x.register_hook(lambda grad: time.sleep(PAUSE))
        return x.clone()


def test_each_stage_and_micro_batch_is_a_span_and_the_bubble_is_measured_beside_gpipes(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), Sleep(), nn.Linear(8, 8), Sleep())
    strategy = sg.ModelParallelStrategy(["cpu:0", "cpu:1"], split_points=[2], num_micro_batches=MICRO)
    model, opt = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.01))

    def step(x: torch.Tensor) -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    with strategy.trace(tmp_path):
        for _ in range(STEPS):
            strategy.run(step, args=(torch.randn(16, 8),))
    strategy.close()
    document = json.loads(gzip.decompress(merge(tmp_path).read_bytes()))
    assert problems(document) == []
    tracks = {e["tid"]: e["args"]["name"] for e in document["traceEvents"] if e.get("name") == "thread_name"}
    spans = [(tracks[e["tid"]], e["name"]) for e in document["traceEvents"] if e["ph"] == "X"]
    for stage in range(STAGES):
        for micro in range(MICRO):
            for phase in ("forward", "backward"):
                assert spans.count((f"stage {stage}", f"{phase} {micro}")) == STEPS, (stage, micro, phase)
    assert sum(1 for track, name in spans if track == "main" and name.startswith("step ")) == STEPS

    events = [e for e in document["traceEvents"] if e["ph"] == "X"]
    bubble = summarize(load(tmp_path)).pipeline
    assert bubble is not None
    assert (bubble.num_stages, bubble.num_micro_batches, bubble.gpipe) == (STAGES, MICRO, 1 / 5)  # (2-1)/(4+2-1)
    # The bubble worked out from the merged file's events, step by step: 1 - busy / (stages x window).
    for step in range(1, STEPS + 1):
        work = [e for e in events if "micro_batch" in e["args"] and e["args"]["step"] == step]
        assert len(work) == STAGES * MICRO * 2
        window = max(e["ts"] + e["dur"] for e in work) - min(e["ts"] for e in work)
        assert bubble.per_step[step] == pytest.approx(1 - sum(e["dur"] for e in work) / (STAGES * window), abs=0.01)
    # Equal work per piece: the measured bubble is GPipe's, give or take the hand-overs between stage threads.
    assert abs(bubble.median - bubble.gpipe) < 0.08, bubble


def test_fit_leaves_a_sampled_summary_trace_on_a_pipeline_and_trace_false_turns_it_off():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    strategy = sg.ModelParallelStrategy(["cpu:0", "cpu:1"], split_points=[2], num_micro_batches=2)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(5)]
    try:
        history = sg.fit(strategy, net, torch.optim.SGD(net.parameters(), lr=0.01), F.cross_entropy, data, epochs=2)
        trace = history.trace
        assert trace is not None and trace.num_steps == 10 and 1 <= trace.num_recorded <= 10, trace
        assert [r.step for r in trace.summary.rows][0] == 1 and len(trace.summary.rows) == trace.num_recorded
        for row in trace.summary.rows:
            assert row.task == "worker:0" and row.parts_ms == pytest.approx(row.step_ms, rel=0.02), row
        again = sg.fit(strategy, history.model, history.optimizer, F.cross_entropy, data, trace=False)
        assert again.trace is None
    finally:
        strategy.close()
