"""ShardedStrategy's workers handed different batches are stopped naming the step, the workers and the input
(issue 27, item 6, as under MultiWorkerMirroredStrategy); its barrier, `distribute_dataset(batch_dim=1)` and
`shard="off"`/`"file"` (issue 27). Two real processes on 127.0.0.1 (sharded_agree_cases.py)."""

from __future__ import annotations

import pytest
import sharded_agree_cases
import torch
from helpers import free_port, run_ranks

import stratagem as sg


def test_check_batches_must_be_a_bool():
    with pytest.raises(sg.InputError, match=r"check_batches must be True or False. Received: check_batches='yes'"):
        sg.ShardedStrategy(check_batches="yes")


@pytest.mark.multiprocess
@pytest.mark.sharded
@pytest.mark.timeout(300)
def test_equal_batches_train_as_one_device_and_a_worker_handed_another_is_stopped():
    ports = [free_port(), free_port()]
    outcomes = run_ranks(sharded_agree_cases.agreement_case, [0, 1], args=(ports,), timeout=280)
    for outcome in outcomes.values():
        assert outcome.error is None, outcome.error
    for rank, outcome in outcomes.items():
        got = outcome.value
        assert got["equal steps"] == 3 and got["equal worst"] <= 1e-12, (rank, got)
        # torch.save, pickle and copy.deepcopy of the model: refused up front, naming why and the fix (issue 27).
        assert len(got["copies refused"]) == 3
        for message in got["copies refused"]:
            assert message.startswith("A ShardedStrategy model cannot be saved whole, pickled or deep-copied"), message
            assert "(1/2, FSDP2's DTensors)" in message and "full_state_dict=True" in message, message
        assert got["saved whole worst"] <= 1e-12, got["saved whole worst"]
        # (seq, batch) inputs cut along dimension 1: 7 and 6 of 13, then 4 and 4 of 8, trained as one device.
        assert got["batch_dim shapes"] == ([(4, 7, 6), (4, 4, 6)] if rank == 0 else [(4, 6, 6), (4, 4, 6)])
        assert got["batch_dim steps"] == 2 and got["batch_dim worst"] <= 1e-12, (rank, got)
        assert got["off steps"] == 2 and got["off worst"] <= 1e-12, (rank, got)
        assert got["file"].startswith("ShardedStrategy reads files through the data-parallel cut"), got["file"]
        assert "Received: shard='file'" in got["file"]
        assert got["barriers"] < 30, got["barriers"]
        # 3 + 2 + 2 steps before: the second batch of the last pass is step 9; both workers stop there, before it.
        assert "disagree steps" not in got, got
        assert got["disagree"].startswith(
            "The workers disagree at step 9: worker:1 (rank 1) does not hold what the chief (worker:0, rank 0) "
            "holds; the first input that differs is tensor 0 of the batch (shape (13, 6), torch.float64)."
        ), got["disagree"]
        assert "Pass check_batches=False to ShardedStrategy (on every worker)" in got["disagree"]


@pytest.mark.multiprocess
@pytest.mark.sharded
@pytest.mark.timeout(300)
def test_the_check_can_be_turned_off_and_a_worker_missing_the_barrier_is_named():
    ports = [free_port(), free_port()]
    timeout = 15.0
    outcomes = run_ranks(
        sharded_agree_cases.check_off_then_missing_barrier_case, [0, 1], args=(ports, timeout), timeout=200
    )
    for outcome in outcomes.values():
        assert outcome.error is None, outcome.error
        assert outcome.value["steps"] == 2, outcome.value
    chief = outcomes[0].value
    assert chief["error"] is not None and chief["error"].startswith(
        "worker:0 (rank 0): the barrier of step 1 timed out after waiting for the other workers;"
    ), chief["error"]
    assert "worker:1 (rank 1)" in chief["error"]
    assert timeout <= chief["waited"] < timeout + 30, chief["waited"]


def test_a_wrapped_model_without_a_refusal_still_copies_and_pickles_as_its_module():
    import copy
    import pickle

    from torch import nn

    from stratagem.strategies.wrapped_model import WrappedModel

    inner = nn.Linear(3, 2)
    wrapped = WrappedModel(inner, "ModelParallelModel")
    for copied in (copy.deepcopy(wrapped), pickle.loads(pickle.dumps(wrapped))):
        assert type(copied) is nn.Linear and copied is not inner
        assert torch.equal(copied.weight, inner.weight)
    refused = WrappedModel(inner, "ShardedModel", copy_refused="no copies here. Received: a test. Fix: none.")
    with pytest.raises(sg.InputError, match="no copies here"):
        copy.deepcopy(refused)
    with pytest.raises(sg.InputError, match="no copies here"):
        pickle.dumps(refused)


def test_a_step_whose_inputs_never_went_through_the_strategy_agrees_on_the_step_alone():
    # Before: a run() with the batch handed straight to it (no distribute_dataset) failed unpacking the empty note.
    from stratagem.strategies.worker_group.agreement import BatchAgreement

    names = ["worker:0", "worker:1"]
    chief, other = (BatchAgreement(rank=r, task_names=names, strategy="ShardedStrategy") for r in (0, 1))
    chief.check((chief.slots(2, torch.float32) + other.slots(2, torch.float32)).tolist(), 2)  # no error
    with pytest.raises(sg.InputError, match=r"different steps. Received: step 1 there, step 2 on the chief.*ShardedS"):
        chief.check((chief.slots(2, torch.float32) + other.slots(1, torch.float32)).tolist(), 2)


@pytest.mark.multiprocess
@pytest.mark.sharded
@pytest.mark.timeout(300)
def test_check_batches_set_between_steps_stops_before_any_update_and_names_a_worker_with_it_off():
    ports = [free_port(), free_port()]
    outcomes = run_ranks(sharded_agree_cases.check_batches_setter_case, [0, 1], args=(ports, 20.0), timeout=280)
    for outcome in outcomes.values():
        assert outcome.error is None, outcome.error
    for rank, outcome in outcomes.items():
        got = outcome.value
        assert got["refused"] == "check_batches must be True or False. Received: check_batches='off'. Pass a bool."
        assert got["on at first"] is True
        # Off on every worker: rank 1's other batches train without a word.
        assert got["off"] == (None, ["backward", "update"] * 2), (rank, got["off"])
        # On again: an evaluation (no reduce-scatter) is stopped when its step function returns ...
        message, events = got["evaluation"]
        assert events == ["evaluated"], (rank, events)
        assert message is not None and message.startswith(
            "The workers disagree at step 3: worker:1 (rank 1) does not hold what the chief (worker:0, rank 0) "
            "holds; the first input that differs is tensor 0 of the batch (shape (13, 6), torch.float64)."
        ), message
        # ... and a training step inside its backward, before the first gradient is summed: nothing updated.
        message, events = got["training"]
        assert events == [], (rank, events)
        assert message is not None and message.startswith("The workers disagree at step 4: worker:1 (rank 1)"), message
        assert got["shards unchanged"] is True
    # Off on rank 1 only: the chief names it; rank 1, which compares nothing, is left in the next collective.
    named = outcomes[0].value["mixed"]
    assert named.startswith(
        "The workers disagree at step 5: worker:1 (rank 1) does not hold what the chief (worker:0, rank 0) holds; "
        "check_batches=False on that worker only. Received: the check on some workers and not on others."
    ), named
    assert outcomes[1].value["mixed"] is not None, outcomes[1].value["mixed"]


def test_check_batches_refuses_a_value_that_is_not_a_bool_between_steps():
    from types import SimpleNamespace

    from stratagem.strategies.worker_group.step_agreement import StepAgreement

    agreement = StepAgreement(SimpleNamespace(rank=0, task_names=("worker:0",)), enabled=True)  # type: ignore[arg-type]
    agreement.enabled = False
    assert agreement.enabled is False and agreement.batch.enabled is False
    with pytest.raises(sg.InputError, match=r"check_batches must be True or False. Received: check_batches=1. Pass"):
        agreement.enabled = 1  # type: ignore[assignment]


def test_the_fingerprint_rides_a_bfloat16_reduce_scatter_exactly_beside_the_weighted_gradients(tmp_path):
    # One rank (a FileStore, no port): the layout and the dtypes; two ranks are the multi-process tests above.
    import torch.distributed as dist

    from stratagem.strategies.sharded.reduce_scatter import WeightedReduceScatter

    class Rider:
        def __init__(self) -> None:
            self.sent = torch.tensor([1.0, 255.0, 0.0, 128.0, 7.0], dtype=torch.bfloat16)
            self.summed: list[torch.Tensor] = []

        def ride(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
            return self.sent.to(dtype) if not self.summed else None  # the first reduce-scatter of the step only

        def landed(self, summed: torch.Tensor) -> None:
            self.summed.append(summed.clone())

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        comm, rider = WeightedReduceScatter(), Rider()
        comm.rider = rider  # type: ignore[assignment]
        comm.weight = 0.5
        for _ in range(2):
            grads = torch.arange(6, dtype=torch.bfloat16) * 3
            out = torch.empty(6, dtype=torch.bfloat16)
            assert comm(out, grads.clone(), dist.group.WORLD, dist.ReduceOp.SUM) is None
            assert torch.equal(out, grads * 0.5), out
    finally:
        dist.destroy_process_group()
    assert len(rider.summed) == 1 and torch.equal(rider.summed[0], rider.sent), rider.summed
