"""Gradient buckets without a process group: the launch function records what would be all-reduced."""

from __future__ import annotations

import torch
from torch import nn

from stratagem.collective.buckets import GradientBuckets


def params(*sizes: int) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(n)) for n in sizes]


class Recorder:
    """Stands in for dist.all_reduce(async_op=True): doubles each tensor, as a sum over two equal ranks would."""

    def __init__(self) -> None:
        self.launched: list[int] = []

    def __call__(self, tensor: torch.Tensor) -> str:
        self.launched.append(tensor.numel())
        tensor.mul_(2)
        return f"work{len(self.launched)}"


def test_buckets_follow_reverse_order_with_a_small_first_bucket_and_direct_large_gradients():
    ps = params(300, 10, 10, 1000, 10, 10)  # 4-byte floats
    buckets = GradientBuckets(ps, bucket_bytes=200, first_bucket_bytes=80, direct_bytes=1000)
    # Reverse order: 10, 10 (first bucket, 80 B) | 1000 direct | 10, 10 | 300 direct.
    assert [b.members for b in buckets.buckets] == [[5, 4], [3], [2, 1], [0]]
    assert [b.direct for b in buckets.buckets] == [False, True, False, True]
    assert buckets.describe() == "0.00, direct 0.00, 0.00, direct 0.00"


def test_a_bucket_closes_once_it_reaches_its_limit_so_a_large_gradient_starts_early():
    ps = params(500, 10, 1000, 10, 10)  # the MLP's shape: small last layer, large middle layer
    buckets = GradientBuckets(ps, bucket_bytes=10**6, first_bucket_bytes=100, direct_bytes=10**9)
    # Reverse order: 40 + 40 B stay under the first limit; the 4000 B gradient joins that bucket, which is
    # then full and launches as soon as it arrives, while the first layer's gradient is still being computed.
    assert [b.members for b in buckets.buckets] == [[4, 3, 2], [1, 0]]
    record = Recorder()
    buckets.start(1.0)
    for i in (4, 3, 2):
        ps[i].grad = torch.ones_like(ps[i])
        buckets.mark_ready(i, record)
    assert record.launched == [1020]


def test_buckets_launch_in_order_only_when_complete_and_weight_each_gradient():
    ps = params(4, 4, 4)
    for i, p in enumerate(ps):
        p.grad = torch.full((4,), float(i + 1))
    buckets = GradientBuckets(ps, bucket_bytes=16, first_bucket_bytes=16, direct_bytes=10**9)
    record = Recorder()
    buckets.start(0.25)
    buckets.mark_ready(0, record)  # bucket 2 (param 0) is complete but buckets 0 and 1 are not: wait
    assert record.launched == []
    buckets.mark_ready(2, record)  # bucket 0 launches, then bucket 1 still waits for param 1
    assert record.launched == [4]
    buckets.mark_ready(1, record)
    assert record.launched == [4, 4, 4]
    assert buckets.finish(record) == ["work1", "work2", "work3"]
    buckets.hand_out()
    for i, p in enumerate(ps):  # weighted by 0.25, then "summed" over two ranks
        assert torch.equal(p.grad, torch.full((4,), (i + 1) * 0.25 * 2))


def test_gradients_become_views_of_their_bucket_and_in_place_accumulation_is_weighted_in_place():
    ps = params(3, 5)
    buckets = GradientBuckets(ps, bucket_bytes=10**6, first_bucket_bytes=10**6, direct_bytes=10**9)
    (bucket,) = buckets.buckets
    record = Recorder()
    buckets.start(0.5)
    for i, p in enumerate(ps):
        p.grad = torch.full_like(p, float(i + 1))
        buckets.mark_ready(i, record)
    buckets.finish(record)
    buckets.hand_out()  # no copy back: each gradient is its slice of the bucket
    for p in ps:
        assert p.grad.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr()
    assert torch.equal(bucket.flat, torch.tensor([2.0] * 5 + [1.0] * 3))  # reverse order, weighted and summed
    # zero_grad(set_to_none=False) and a backward pass accumulate into the views themselves.
    for i, p in enumerate(ps):
        p.grad.zero_()
        p.grad += 4.0 * (i + 1)
    buckets.start(0.25)
    for i in range(len(ps)):
        buckets.mark_ready(i, record)
    buckets.finish(record)
    buckets.hand_out()
    assert torch.equal(ps[0].grad, torch.full((3,), 2.0)) and torch.equal(ps[1].grad, torch.full((5,), 4.0))


def test_a_direct_gradient_is_all_reduced_in_place_in_chunks():
    (p,) = params(3 * 1024 * 1024)  # 12 MiB
    p.grad = torch.ones_like(p)
    grad = p.grad
    buckets = GradientBuckets([p], bucket_bytes=4 * 1024 * 1024, direct_bytes=1024)
    record = Recorder()
    buckets.start(0.5)
    buckets.mark_ready(0, record)
    # A 1 MiB first chunk, then chunks of the bucket size (4 MiB), in place: no copy.
    assert record.launched == [262144, 1048576, 1048576, 786432]
    assert p.grad is grad and torch.equal(grad, torch.ones_like(grad))


def test_an_empty_slice_contributes_zeros_even_when_its_gradient_is_nan():
    small, big = params(4, 2048)
    small.grad = torch.full((4,), float("nan"))
    big.grad = torch.full((2048,), float("nan"))
    buckets = GradientBuckets([small, big], direct_bytes=4096)
    record = Recorder()
    buckets.start(0.0)
    buckets.mark_ready(1, record)
    buckets.mark_ready(0, record)
    buckets.finish(record)
    buckets.hand_out()
    assert torch.equal(small.grad, torch.zeros(4)) and torch.equal(big.grad, torch.zeros(2048))


def test_an_unused_parameter_contributes_zeros_at_the_end_of_backward():
    used, unused = params(4, 4)
    used.grad = torch.ones(4)
    buckets = GradientBuckets([used, unused], bucket_bytes=1024)
    record = Recorder()
    buckets.start(1.0)
    buckets.mark_ready(0, record)
    assert record.launched == []  # the bucket also holds the unused parameter
    buckets.finish(record)
    buckets.hand_out()
    assert record.launched == [8]
    assert torch.equal(used.grad, torch.full((4,), 2.0)) and torch.equal(unused.grad, torch.zeros(4))
