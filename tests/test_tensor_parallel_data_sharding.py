"""Weights sharded along the `data` axis too (ZeRO-3 on FSDP2, after the tensor-parallel split): trained as one
device trains, planned as held, and a backup of their shards resumes at another layout exactly. One launch of 4
workers serves all three (the set-up is the cost: spawning and importing torch)."""

from __future__ import annotations

import pytest
import tensor_parallel_cases as cases
import tensor_parallel_checkpoint_cases as checkpoint_cases
from helpers import free_port, run_ranks

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.timeout(500)
def test_gpt2_with_weights_sharded_along_data_trains_as_one_device_and_its_backup_resumes_elsewhere(tmp_path):
    # c_fc's weights ("data", "model"), the tied embedding ("model", "data") and ln_f ("data",), on the 2x2 mesh
    # with the uneven global batch of 13, AdamW and clipping; a backup after the first step.
    ports = [free_port() for _ in range(4)]
    args = (ports, (2, 2), ("data", "model"), True, str(tmp_path))
    written = run_ranks(cases.exactness, range(4), args=args, timeout=300)
    for rank, outcome in written.items():
        assert outcome.error is None, outcome.error
        result = outcome.value
        assert result["worst"] <= 1e-9, f"rank {rank}: parameters off by {result['worst']:.2e} relative"
        assert result["norms"] <= 1e-9 and result["losses"] <= 1e-9, (result["norms"], result["losses"])
        # 1/2 along data of each model part, parameter and AdamW's state alike; c_proj replicated along data.
        shapes, states = result["local shapes"], result["state shapes"]
        assert shapes["transformer.h.0.mlp.c_fc.weight"] == (24, 96) == states["transformer.h.0.mlp.c_fc.weight"]
        assert shapes["transformer.wte.weight"] == ((1025, 24) if rank % 2 == 0 else (1024, 24))
        assert shapes["transformer.ln_f.weight"] == (24,) == states["transformer.ln_f.weight"]
        assert shapes["transformer.h.0.mlp.c_proj.weight"] == (96, 48)
        # The memory plan cuts the shards as FSDP2 does: what the rank holds after training (zero_grad() freed the
        # gradients, planned in the parameters' layout).
        held, plan = result["held"], result["plan"]
        assert (held["parameters"], held["optimizer_state"]) == (plan["parameters"], plan["optimizer_state"])
        assert plan["gradients"] == plan["parameters"]
        assert result["plan"]["data_sharding_buffers"] > 0
    explain = written[0].value["explain"]
    assert (
        "techniques: tensor parallel on model, then data sharding on data (4 parameter(s)), then replication" in explain
    )
    assert "data sharding: 4 parameter(s) sharded along 'data'" in explain  # c_fc twice, the tied wte, ln_f
    assert "transformer.ln_f.weight (48,): ('data',) (key 'ln_f\\\\.weight'; sharded along 'data'" in explain

    # Read back at 2 model workers, with no data axis and nothing sharded along it, and the second step taken there.
    ports = [free_port(), free_port()]
    resumed = run_ranks(checkpoint_cases.resume, [0, 1], args=(ports, str(tmp_path)), timeout=240)
    for outcome in resumed.values():
        assert outcome.error is None, outcome.error
    there, after = resumed[0].value, written[0].value["after"]
    for name, value in after[0].items():  # every shard along data read back into its whole
        assert (there["loaded"][name] == value).all(), name
    for name, value in after[1].items():  # AdamW's state too: the next step is the same step
        worst = abs(there["after two"][name] - value).max() / abs(value).max()
        assert worst <= 1e-9, f"{name} {worst:.2e} relative"
