"""Workers of a synchronous job that were handed different batches, or are at different steps, are stopped
with an error naming the step, the workers and the first input that differs (issue 27, item 6). Real
processes on 127.0.0.1 under `stratagem launch`, and the fingerprint's rule on its own."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import launch_json_workers

from stratagem.errors import InputError
from stratagem.strategies.worker_group.agreement import SLOT, BatchAgreement, tensor_digest


def _launched(**settings) -> tuple[int, dict[int, dict]]:
    code, outcomes, lines = launch_json_workers("mwms_disagree.py", settings, timeout=120)
    assert sorted(outcomes) == [0, 1], "\n".join(lines[-40:])
    return code, outcomes


def _summed(*agreements: BatchAgreement, step: int) -> list[float]:
    return torch.stack([a.slots(step, torch.float32) for a in agreements]).sum(0).tolist()


def _pair(**kwargs) -> tuple[BatchAgreement, BatchAgreement]:
    names = ["worker:0", "worker:1"]
    return BatchAgreement(rank=0, task_names=names, **kwargs), BatchAgreement(rank=1, task_names=names, **kwargs)


def test_equal_batches_agree_and_each_slot_travels_exactly_even_in_bfloat16():
    chief, other = _pair()
    x, y = torch.randn(16, 4), torch.arange(16)
    for a in (chief, other):
        a.note_global_batch((x.clone(), y.clone()), 16)
    chief.check(_summed(chief, other, step=70_000), 70_000)  # no error
    wire = chief.slots(70_000, torch.bfloat16) + other.slots(70_000, torch.bfloat16)
    assert wire.tolist() == _summed(chief, other, step=70_000) and len(wire) == 2 * SLOT


def test_a_different_second_input_is_named_with_the_step_and_the_worker():
    chief, other = _pair()
    x, y = torch.randn(16, 4), torch.arange(16)
    chief.note_global_batch((x, y), 16)
    other.note_global_batch((x, y.flip(0)), 16)  # same values, another order
    with pytest.raises(
        InputError,
        match=r"The workers disagree at step 5: worker:1 \(rank 1\) does not hold what the "
        r"chief \(worker:0, rank 0\) holds; the first input that differs is tensor 1 of the batch "
        r"\(shape \(16,\), torch.int64\).*check_batches=False",
    ):
        other.check(_summed(chief, other, step=5), 5)


def test_workers_at_different_steps_or_with_different_sizes_or_a_check_off_are_named():
    chief, other = _pair()
    x = torch.randn(16, 4)
    chief.note_global_batch((x,), 16)
    other.note_global_batch((x,), 16)
    summed = (chief.slots(4, torch.float64) + other.slots(3, torch.float64)).tolist()
    with pytest.raises(InputError, match=r"at step 4: .*different steps. Received: step 3 there, step 4 on the chief"):
        chief.check(summed, 4)
    other.note_global_batch((x[:12],), 12)
    with pytest.raises(InputError, match=r"global batch sizes differ. Received: 12 examples there, 16 on the chief"):
        chief.check(_summed(chief, other, step=4), 4)
    other.enabled = False
    with pytest.raises(InputError, match=r"check_batches=False on that worker only"):
        chief.check(_summed(chief, other, step=4), 4)


def test_check_batches_must_be_a_bool():
    import stratagem as sg

    with pytest.raises(InputError, match=r"check_batches must be True or False. Received: check_batches='yes'"):
        sg.MultiWorkerMirroredStrategy(check_batches="yes")


def test_the_digest_is_exact_integer_arithmetic_independent_of_threads():
    x = torch.randn(257, 33, dtype=torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tensor_digest(x)
        torch.set_num_threads(max(2, before))
        assert tensor_digest(x) == one
    finally:
        torch.set_num_threads(before)
    assert tensor_digest(x.clone()) == one and tensor_digest(x[[1, 0, *range(2, 257)]]) != one
    assert tensor_digest(x.to(torch.float64)) != one  # the dtype is part of it


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("shm", ["", "0"], ids=["shared-memory", "gloo"])
def test_a_chief_whose_shuffle_was_shifted_stops_both_workers_at_the_first_step(shm):
    # Before: training ran on halves of two different shuffles without a word (issue 27: 0.34 away from one device).
    code, outcomes = _launched(AG_MODE="loader", AG_EVAL_CHIEF=1, AG_SHM=shm)
    assert code != 0
    for outcome in outcomes.values():
        assert outcome.get("error") == "InputError", outcome
        assert outcome["message"].startswith(
            "The workers disagree at step 1: worker:1 (rank 1) does not hold what the chief (worker:0, rank 0) holds; "
            "the first input that differs is the global batch's example indices (its sampler)."
        ), outcome


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_worker_handed_other_values_through_step_is_stopped_naming_the_input():
    code, outcomes = _launched(AG_MODE="step", AG_SHIFT_RANK=1)
    assert code != 0
    for outcome in outcomes.values():
        assert "The workers disagree at step 1: worker:1 (rank 1)" in outcome["message"], outcome
        assert (
            "the first input that differs is tensor 0 of the batch (shape (8, 4), torch.float32)" in outcome["message"]
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_equal_batches_train_and_the_check_can_be_turned_off():
    code, outcomes = _launched(AG_MODE="batches")
    assert code == 0 and [o["steps"] for o in outcomes.values()] == [6, 6], outcomes
    code, outcomes = _launched(AG_MODE="batches", AG_SHIFT_RANK=1, AG_CHECK=0)
    assert code == 0 and [o["steps"] for o in outcomes.values()] == [6, 6], outcomes


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_workers_whose_data_sets_were_built_from_other_seeds_are_stopped_and_equal_seeds_train():
    # Before (issue 38): a DataLoader cut at the index level was checked by its sampler's indices only, which agree
    # when each worker builds another data set, so each worker trained on other data without a word.
    code, outcomes = _launched(AG_MODE="loader", AG_SHIFT_RANK=1)
    assert code != 0
    for outcome in outcomes.values():
        assert outcome.get("error") == "InputError", outcome
        assert re.match(
            r"The workers disagree at step 1: worker:1 \(rank 1\) does not hold what the chief \(worker:0, rank 0\) "
            r"holds; their data sets differ: the global batch's first example \(index \d+\), which every worker reads "
            r"for this check, has other values there\. Received: a different hash of its values\. .*Every worker must "
            r"build the same data set: seed the random numbers that make it",
            outcome["message"],
        ), outcome
    code, outcomes = _launched(AG_MODE="loader")
    assert code == 0 and [o["steps"] for o in outcomes.values()] == [6, 6], outcomes
    assert outcomes[0]["losses"] == outcomes[1]["losses"]
