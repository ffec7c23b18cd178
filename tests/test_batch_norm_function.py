"""The per-channel arithmetic of exact BatchNorm: on a CPU in float32 and float64 it runs in NumPy, elsewhere
(a GPU, bfloat16 statistics) in torch; both give the same statistics and coefficients, and training through
either equals one device. These are the Python meetings: the native ones (batch_norm_native.py, whose results
tests/test_batch_norm_native.py checks against these) are turned off here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cases import TOL
from hypothesis import given, settings
from hypothesis import strategies as st
from test_batch_norm import assert_states_equal, batches, build, mirrored, train_distributed, train_reference

from stratagem.strategies.data_parallel import batch_norm_function as bnf
from stratagem.strategies.data_parallel.cpu_threads import batch_norm_native

DTYPES = [torch.float32, torch.float64]


@pytest.fixture(autouse=True)
def python_meetings(monkeypatch):
    monkeypatch.setattr(batch_norm_native, "extension", lambda: (None, "the test runs the Python meetings"))


@st.composite
def forward_shares(draw):
    """1-3 replicas' (count, mean, biased variance) over the same channels, some replicas without examples."""
    channels = draw(st.integers(1, 9))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    shares = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()) and shares:
            shares.append(None)  # an empty slice's stand-in: no contribution
            continue
        count = draw(st.integers(1, 40))
        mean = (torch.randn(channels, generator=g, dtype=torch.float64) * 10 ** draw(st.integers(-3, 3))).to(dtype)
        var = (torch.rand(channels, generator=g, dtype=torch.float64) * 10 ** draw(st.integers(-4, 2))).to(dtype)
        shares.append(bnf.ForwardShare(count, mean, var, None))
    return shares, channels, dtype


def assert_statistics_equal(got: bnf.ForwardStatistics, want: bnf.ForwardStatistics) -> None:
    """Equal up to the rounding of float64 sums added in another order: a few units in the last place, which the
    variance (the mean of the squares less the squared mean) sees relative to the mean of the squares, and the mean
    relative to its root."""
    assert got.size == want.size
    squares = (want.mean.double() ** 2 + want.var.double()).max()
    for field in ("mean", "var", "invstd", "running_mean", "running_var"):
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None) == (b is None), field
        if a is None:
            continue
        assert a.dtype == b.dtype, field
        eps = torch.finfo(a.dtype).eps
        if field in ("var", "running_var"):
            torch.testing.assert_close(a, b, rtol=4 * eps, atol=8 * eps * float(squares), msg=field)
        elif field == "invstd":
            spread = float((squares / (want.var.double() + 1e-5)).max())
            torch.testing.assert_close(a, b, rtol=4 * eps + 4 * eps * spread, atol=0, msg=field)
        else:
            # The mean's sum cancels where the replicas' means differ in sign: its rounding is relative to the sum of
            # their magnitudes, which the root of the mean of the squares bounds.
            torch.testing.assert_close(a, b, rtol=4 * eps, atol=4 * eps * float(squares) ** 0.5, msg=field)


@settings(max_examples=60, deadline=None)
@given(forward_shares(), st.sampled_from([None, torch.float32, torch.float64]))
def test_numpy_and_torch_give_the_same_forward_statistics(case, running_dtype):
    shares, channels, dtype = case
    present = [s for s in shares if s is not None]
    size = sum(s.count for s in present)
    for s in present:
        s.part = bnf._forward_part(s)
    summed = bnf._sum_parts([s.part for s in present], 2 * channels + 1)
    total = bnf._sum_forward(present, channels, torch.device("cpu"))
    # torch may fuse count * mean into the addition (one rounding fewer): equal to a few units in the last place of
    # the summands' magnitudes, which is what a sum that cancels keeps of them.
    magnitude = torch.from_numpy(sum(np.abs(s.part) for s in present))
    assert bool(((torch.from_numpy(summed) - total).abs() <= 4 * torch.finfo(torch.float64).eps * magnitude).all())
    assert summed[-1] == size
    if size <= 1:
        return
    got = bnf._forward_statistics(summed, channels, dtype, running_dtype, 1e-5)
    want = bnf._forward_statistics_torch(total, channels, dtype, running_dtype, 1e-5)
    assert_statistics_equal(got, want)
    # Against the definition: the mean and biased variance of the pooled values.
    pooled_mean = sum(s.count * s.mean.double() for s in present) / size
    pooled_var = sum(s.count * (s.var.double() + (s.mean.double() - pooled_mean) ** 2) for s in present) / size
    torch.testing.assert_close(got.mean.double(), pooled_mean, **TOL[dtype])
    torch.testing.assert_close(
        got.var.double(),
        pooled_var,
        rtol=TOL[dtype]["rtol"],
        atol=1e-5 * float(pooled_mean.abs().max()) ** 2 + TOL[dtype]["atol"],
    )


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 9),
    st.sampled_from(DTYPES),
    st.lists(st.floats(0.1, 5.0), min_size=1, max_size=3),
    st.booleans(),
    st.integers(2, 4),
    st.integers(0, 2**16),
)
def test_numpy_and_torch_give_the_same_backward_coefficients(channels, dtype, shares, affine, dims, seed):
    g = torch.Generator().manual_seed(seed)
    parts = []
    sums = []
    for share in shares:
        sum_dy, sum_dy_xhat = torch.randn(2, channels, generator=g, dtype=torch.float64).to(dtype)
        parts.append(bnf._backward_part(share, sum_dy, sum_dy_xhat))
        sums.append(bnf.BackwardShare(share, sum_dy, sum_dy_xhat, None))
    summed = bnf._sum_parts(parts, 2 * channels)
    total = bnf._sum_backward(sums, channels, torch.device("cpu"))
    # Sums of terms of both signs, added in another order: equal up to the rounding of the terms' magnitudes.
    magnitude = sum(s.share * torch.cat([s.sum_dy, s.sum_dy_xhat]).double().abs() for s in sums)
    assert bool(((torch.from_numpy(summed) - total).abs() <= 4 * torch.finfo(torch.float64).eps * magnitude).all())
    var = torch.rand(channels, generator=g, dtype=torch.float64).to(dtype) + 0.1
    stats = bnf.ForwardStatistics(
        mean=torch.zeros(channels, dtype=dtype),
        var=var,
        invstd=torch.rsqrt(var + 1e-5),
        running_mean=None,
        running_var=None,
        size=37.0,
    )
    weight = torch.randn(channels, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if affine else None
    like = torch.zeros((2, channels, *([3] * (dims - 2))), dtype=dtype)
    got = bnf._coefficients(summed, shares[0], stats, weight, like)
    want = bnf._coefficients(total, shares[0], stats, weight, like)
    gain_abs = (stats.invstd * (weight.detach() if affine else 1)).double().abs()
    bound = gain_abs * magnitude.view(2, channels) / (shares[0] * stats.size)  # what rounding of the sums moves
    for a, b, name, slack in zip(got, want, ("gain", "shift", "scale"), (None, bound[0], bound[1])):
        assert a.shape == b.shape, name
        eps = torch.finfo(dtype).eps
        if slack is None:
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
        else:
            assert bool(((a.double() - b.double()).abs() <= 4 * eps * b.double().abs() + 8 * eps * slack).all()), name
    assert got[0].shape == (1, channels, *([1] * (dims - 2)))
    # -(w / sigma) * (the weighted mean of sum dy) / share, as the formula in the autograd function says.
    gain = stats.invstd * (weight.detach() if affine else 1)
    expected_shift = -gain.double() * total[:channels] / (shares[0] * stats.size)
    torch.testing.assert_close(got[1].double(), expected_shift, **TOL[dtype])


def _train_conv(dtype):
    reference, ref_opt, shape = build("conv", dtype)
    data = batches(shape, sizes=[9, 8, 2], dtype=dtype)
    train_reference(reference, ref_opt, data)
    model, opt, _ = build("conv", dtype)
    strategy = mirrored(2)
    model, _ = train_distributed(strategy, model, opt, data)
    strategy.close()
    return reference, model


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_cpu_run_takes_the_numpy_path_and_matches_one_device(monkeypatch, dtype):
    calls = {"forward": 0, "backward": 0}
    forward, backward = bnf._forward_statistics, bnf._backward_part

    def counted_forward(*args):
        calls["forward"] += 1
        return forward(*args)

    def counted_backward(*args):
        calls["backward"] += 1
        return backward(*args)

    def torch_path(*args):
        raise AssertionError("a CPU run in float32 or float64 took the torch path")

    monkeypatch.setattr(bnf, "_forward_statistics", counted_forward)
    monkeypatch.setattr(bnf, "_backward_part", counted_backward)
    monkeypatch.setattr(bnf, "_forward_statistics_torch", torch_path)
    monkeypatch.setattr(bnf, "_sum_backward", torch_path)
    reference, model = _train_conv(dtype)
    assert_states_equal(reference, model.replicas, dtype)
    # 3 steps, 2 layers: one forward meeting per layer and step; 2 replicas' backward parts each.
    assert calls == {"forward": 6, "backward": 12}


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_torch_path_trains_like_one_device(monkeypatch, dtype):
    # What a GPU or bfloat16 statistics take: forced here on a CPU.
    def no_numpy_part(*args):
        raise AssertionError("the torch path made a NumPy part")

    monkeypatch.setattr(bnf, "_in_numpy", lambda *tensors: False)
    monkeypatch.setattr(bnf, "_forward_part", no_numpy_part)
    monkeypatch.setattr(bnf, "_backward_part", no_numpy_part)
    reference, model = _train_conv(dtype)
    assert_states_equal(reference, model.replicas, dtype)


def test_replicas_with_and_without_numpy_parts_meet_in_torch(monkeypatch):
    # Replicas on different kinds of device: one brings NumPy sums, the other only tensors; the meeting then
    # sums in torch and every replica still matches one device.
    real = bnf._in_numpy
    seen: list[bool] = []

    def alternate(*tensors):
        seen.append(not seen[-1] if seen else True)
        return seen[-1] and real(*tensors)

    monkeypatch.setattr(bnf, "_in_numpy", alternate)
    reference, model = _train_conv(torch.float64)
    assert_states_equal(reference, model.replicas, torch.float64)
    assert np.any(seen) and not np.all(seen)


def test_numpy_only_borrows_the_layers_tensors():
    # Tensor.numpy() would make a tensor's storage unresizable for good: FSDP2 frees the parameters it gathers by
    # resizing theirs, and the backward's sums become the layer's gradients.
    model, _, shape = build("conv", torch.float32)
    strategy = mirrored(2)
    model = strategy.distribute(model)
    ((x, y),) = batches(shape, sizes=[8], dtype=torch.float32)
    ((piece, labels),) = strategy.distribute_dataset([(x, y)])
    strategy.run(lambda x, y: torch.nn.functional.cross_entropy(model(x), y).backward(), args=(piece, labels))
    for replica in model.replicas:
        for name, p in replica.named_parameters():
            assert p.grad is not None, name
            assert p.untyped_storage().resizable(), name
            assert p.grad.untyped_storage().resizable(), name
    strategy.close()
