"""`model.module` under ShardedStrategy at N=1 and N=2 (issue 27, item 1): the sharded module, with the same
names as the user's model, while the model handed back still trains as one device and still serves FSDP2's
methods and torch.distributed.checkpoint."""

from __future__ import annotations

import pytest
import sharded_module_cases
from helpers import free_port, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.sharded]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("num_workers", [1, 2])
def test_module_is_the_sharded_model_and_training_stays_exact(num_workers):
    ports = [free_port() for _ in range(num_workers)]
    outcomes = run_ranks(sharded_module_cases.module_case, list(range(num_workers)), args=(ports,), timeout=280)
    for outcome in outcomes.values():
        assert outcome.error is None, outcome.error
    for rank, outcome in outcomes.items():
        got = outcome.value
        assert got["module is FSDP2's"], rank
        assert got["distributed_model is the model"], rank
        assert got["same parameters"], rank
        keys, module_keys, user_keys = got["keys"]
        assert keys == module_keys == user_keys == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
        assert got["repr"] == "ShardedModel"
        dcp_keys, module_dcp_keys = got["dcp keys"]
        assert dcp_keys == module_dcp_keys and got["dcp same tensors"], rank
        assert got["worst"] <= 1e-12, (rank, got["worst"])
        assert got["eval reaches the module"] == (False, False)
        assert got["whole state against one device"] <= 1e-12, (rank, got["whole state against one device"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_a_gan_step_its_ema_and_a_frozen_teacher_train_as_one_device(num_workers):
    """Batches of 6, 7, 5 and 4: uneven over 2 and 3 workers, the last one short."""
    ports = [free_port() for _ in range(num_workers)]
    outcomes = run_ranks(sharded_module_cases.several_models_case, list(range(num_workers)), args=(ports,), timeout=280)
    for outcome in outcomes.values():
        assert outcome.error is None, outcome.error
    for rank, outcome in outcomes.items():
        got = outcome.value
        for name in ("generator", "discriminator", "student", "ema", "hand-written ema"):
            assert got[name] <= 1e-12, (rank, name, got[name])
        assert "this one is already sharded by FSDP2" in got["again refused"]  # sharded in place by the first call
        assert "this one is already sharded by FSDP2" in got["sharded refused"]
        assert len(got["inside refused"]) == 1 and "distribute() ran inside strategy.run()" in got["inside refused"][0]
        assert "memory plan (model 2): rank " in got["explain"]
