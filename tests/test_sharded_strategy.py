"""ShardedStrategy as a user's script drives it, across 2 processes on 127.0.0.1: exact against one device at
stage 3 and 2, tiny GPT-2 with tied embeddings and declared token counts, what it reports and refuses."""

from __future__ import annotations

import pytest
import sharded_cases
from helpers import free_port, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.sharded]


@pytest.mark.timeout(300)
def test_the_sharded_strategy_trains_as_one_device_and_says_what_it_holds():
    ports = [(free_port(), free_port()) for _ in range(3)]  # one cluster per strategy the ranks build
    outcomes = run_ranks(sharded_cases.strategy_cases, [0, 1], args=(ports,), timeout=280)
    errors = {rank: outcome.error for rank, outcome in outcomes.items() if outcome.error is not None}
    assert not errors, errors
    for rank, outcome in outcomes.items():
        got = outcome.value
        for stage in (3, 2):
            assert got[f"stage {stage} mlp"] <= 1e-5, (rank, stage, got[f"stage {stage} mlp"])
            assert got[f"stage {stage} user model sharded in place"]
            assert "LBFGS needs every parameter whole" in got[f"stage {stage} LBFGS"]
            explained = got[f"stage {stage} explain"]
            assert f"sharding stage: stage {stage}" in explained
            assert "techniques: data sharding on data" in explained, explained  # sharded/techniques.py, applied
            # Stage 3 gathers a unit per Linear; stage 2 keeps this 1 KiB model as one unit (units.MERGE_UP_TO).
            units = "3 units and the root (0, 2, 4)" if stage == 3 else "the whole model as one unit"
            assert f"sharding units: {units}" in explained, explained
            assert "memory plan: rank " in explained
            assert "memory against a replica: " in explained and "is not divided by N" in explained
            assert got[f"stage {stage} gather"] == (13, 3)
        # Linear(6, 17), Linear(17, 7), Linear(7, 3) in float32, cut in ceil-sized row chunks over 2 ranks.
        rows = [(9, 8), (4, 3), (2, 1)]
        widths = [6 + 1, 17 + 1, 7 + 1]
        assert got["stage 3 plan"][0] == 4 * sum(r[rank] * w for r, w in zip(rows, widths))
        if rank == 0:  # each rank wrote its shards (into a directory of its own here); the chief's holds the backups
            assert [name for name in got["backups"] if name.endswith(".dcp")] == ["backup.dcp", "backup.previous.dcp"]
        # Item 1: the step's activations, measured on fake tensors from this rank's part of the global batch.
        planned, by_itself, how = got["activations"]
        assert planned == by_itself > 0 and how.startswith("measured"), got["activations"]
        assert (
            "not both" in got["activations both"]
            and "Received: example_inputs of type Tensor" in got["activations both"]
        )
        assert got["activations kept"] == planned
        assert "measured on the model before it is sharded" in got["activations sharded"]
        assert "Received: a model already sharded" in got["activations sharded"]
        assert "Received: activations=-1" in got["activations negative"]
        assert got["activations given"] == (2**30, "given", 2**30)
        assert got["gpt2"] <= 1e-5, (rank, got["gpt2"])
        assert got["gpt2 warnings"] == []
