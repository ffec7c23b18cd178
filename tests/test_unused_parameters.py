"""Frozen parameters, parameters used in some steps only and by some replicas only: every strategy gives
one device's parameters, and a parameter that no replica used keeps `grad is None` (so Adam's weight decay
skips it, as on one device)."""

from __future__ import annotations

import pytest
import torch
from conftest import cpu_registry
from helpers import launch_workers
from unused_cases import train_reference, train_with

import stratagem as sg

TOL = dict(rtol=1e-9, atol=1e-12)


def _assert_state(got, expected):
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, **TOL, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize(
    "make",
    [
        lambda: sg.OneDeviceStrategy("cpu"),
        lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(3)),
        lambda: sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3)),
        lambda: sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], share_parameters=False, registry=cpu_registry(3)),
        lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3)),
        lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"], share_parameters=False, registry=cpu_registry(2)),
    ],
    ids=["one-device", "mirrored-2", "mirrored-3", "mirrored-3-copies", "central-3", "central-2-copies"],
)
def test_unused_and_frozen_parameters_match_one_device(make):
    expected, ref_none = train_reference()
    assert ref_none == [False, True, False, False]  # the reference itself: aux unused in step 1 only
    strategy = make()
    state, aux_none = train_with(strategy)
    _assert_state(state, expected)
    # Step 1: no replica used aux (nor `never`): None on every replica; other steps: someone used aux.
    assert [all(step) for step in aux_none] == [False, True, False, False]
    assert [any(step) for step in aux_none] == [False, True, False, False]
    if hasattr(strategy, "close"):
        strategy.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_workers_keep_unused_gradients_none_and_a_second_strategy_follows_close(tmp_path):
    out = tmp_path / "result.pt"
    exit_code, output = launch_workers("mwms_unused.py", {"MW_OUT": str(out)}, timeout=200)
    assert exit_code == 0, output
    saved = torch.load(out)
    expected, _ = train_reference()
    for local in (1, 2):  # one replica per worker (buckets), then two (local sum, then across workers)
        _assert_state(saved[local]["state"], expected)
        assert [all(step) for step in saved[local]["aux_none"]] == [False, True, False, False]
        assert [any(step) for step in saved[local]["aux_none"]] == [False, True, False, False]


def _summed_over_two_ranks(other_used: list[bool]):
    """A launch that stands for an all-reduce with a second rank whose gradients are ones where it used them."""

    def launch(tensor):
        n = len(other_used)
        if tensor.numel() >= n + 2:  # the last collective: gradients, one count per parameter, 2 loss-weight numbers
            tensor[-n - 2 : -2] += torch.tensor(other_used, dtype=tensor.dtype)
        return None

    return launch


@pytest.mark.parametrize("direct_bytes", [10**9, 8], ids=["fused", "direct-last"])
def test_buckets_count_users_so_a_parameter_no_rank_used_keeps_grad_none(direct_bytes):
    from stratagem.collective.buckets import GradientBuckets

    ps = [torch.nn.Parameter(torch.zeros(3)) for _ in range(3)]
    buckets = GradientBuckets(
        ps, bucket_bytes=10**6, first_bucket_bytes=10**6, direct_bytes=direct_bytes, count_users=True
    )
    buckets.start(1.0)
    ps[2].grad = torch.ones(3)
    buckets.mark_ready(2, _summed_over_two_ranks([False, True, False]))  # this rank used 2; the other rank 1
    buckets.finish(_summed_over_two_ranks([False, True, False]))
    buckets.hand_out()
    assert ps[0].grad is None  # nobody used it
    assert ps[1].grad is not None and ps[2].grad is not None
    assert buckets.describe().count(",") == len([b for b in buckets.buckets if b.members]) - 1
