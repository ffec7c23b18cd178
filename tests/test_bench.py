"""The benchmark harness measures what it claims: every configuration trains the same workload."""

from __future__ import annotations

import pytest

from stratagem.bench.suite import Row, render_markdown
from stratagem.bench.throughput import measure_plain, measure_strategy
from stratagem.bench.workloads import WORKLOADS


@pytest.mark.timeout(120)
def test_plain_one_device_and_mirrored_reach_the_same_loss_on_the_mlp_workload():
    workload = WORKLOADS["mlp"]
    plain = measure_plain(workload, warmup=1, steps=3)
    mirrored = measure_strategy("mirrored", workload, replicas=2, warmup=1, steps=3)
    one = measure_strategy("one_device", workload, replicas=1, warmup=1, steps=3)
    assert plain.samples_per_s > 0 and mirrored.samples_per_s > 0
    assert mirrored.final_loss == pytest.approx(plain.final_loss, rel=1e-5)
    assert one.final_loss == pytest.approx(plain.final_loss, rel=1e-6)


def test_markdown_table_shows_medians_and_every_round():
    row = Row("mlp", "mirrored x2", samples_per_s=[10.0, 30.0, 20.0], ratios=[0.8, 1.0, 0.9], final_loss=0.1)
    table = render_markdown([row])
    assert "| mlp | mirrored x2 | 20 | 0.900 | 0.800, 1.000, 0.900 | 0.10000 |" in table
