"""A parameter server's shard store: flat buckets give torch's own updates, shard by shard or bucket by bucket."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stratagem.strategies.parameter_server import store as store_module
from stratagem.strategies.parameter_server import wire
from stratagem.strategies.parameter_server.optimizers import optimizer_spec
from stratagem.strategies.parameter_server.partitioners import place
from stratagem.strategies.parameter_server.server import ParameterServer
from stratagem.strategies.parameter_server.store import ShardStore
from stratagem.strategies.parameter_server.transport import Security
from stratagem.strategies.parameter_server.variables import ShardedVariables

SECURITY = Security(token="store-test")


class NormalizedSGD(torch.optim.SGD):
    """Scales each parameter's gradient by its norm: not elementwise, so it must see whole shards."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(p.grad.norm() + 1e-12)
        return super().step(closure)


def _values():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 4, generator=g, dtype=torch.float64),
        "b": torch.randn(4, generator=g, dtype=torch.float64),
        "v": torch.randn(5, generator=g, dtype=torch.float64),
        "s": torch.randn((), generator=g, dtype=torch.float64),
    }


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(value.shape, generator=g, dtype=torch.float64) for name, value in _values().items()}


def _run(optimizer_class, hypers, groups, steps, used):
    """The store and a plain torch optimizer over whole tensors, fed the same gradients; ``used(step)``
    names the parameters that get a gradient at that step (the others' grad is None, as torch skips them)."""
    values = _values()
    store = ShardStore(values, groups, optimizer_class, hypers)
    reference = {name: torch.nn.Parameter(value.clone()) for name, value in values.items()}
    ref_opt = optimizer_class(
        [{"params": [reference[n] for n in values if groups[n] == i], **h} for i, h in enumerate(hypers)]
    )
    for step in range(steps):
        grads = _grads(step)
        names = used(step)
        for name in names:
            store.grads[name].copy_(grads[name])
        for name, param in reference.items():
            param.grad = grads[name].clone() if name in names else None
        ref_opt.step()
        by_bucket = [f"@{i}" for i, b in enumerate(store.buckets) if set(b.names) <= set(names)]
        rest = [n for n in names if not any(n in store.buckets[int(b[1:])].names for b in by_bucket)]
        store.apply(by_bucket + rest)
    for name, param in reference.items():
        torch.testing.assert_close(store.shards[name].detach(), param.detach(), rtol=1e-12, atol=0)
    return store, ref_opt, reference


@pytest.mark.parametrize(
    "optimizer_class, hypers",
    [
        (
            torch.optim.SGD,
            [{"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}, {"lr": 0.05, "nesterov": True, "momentum": 0.5}],
        ),
        (torch.optim.Adam, [{"lr": 0.01, "amsgrad": True}, {"lr": 0.02, "weight_decay": 0.1}]),
        (torch.optim.RMSprop, [{"lr": 0.01, "momentum": 0.5}, {"lr": 0.02, "centered": True}]),
        (torch.optim.Adagrad, [{"lr": 0.1}, {"lr": 0.2, "lr_decay": 0.01}]),
    ],
)
def test_buckets_update_as_torch_does_per_group(optimizer_class, hypers):
    groups = {"w": 0, "b": 0, "v": 1, "s": 1}
    store, _, _ = _run(optimizer_class, hypers, groups, 4, lambda step: set(groups))
    assert store.flat and len(store.buckets) == 2  # one bucket per group: the optimizer ran over buckets


def test_a_parameter_without_a_gradient_splits_the_buckets_and_keeps_torchs_skip():
    groups = {"w": 0, "b": 0, "v": 0, "s": 0}
    store, ref_opt, reference = _run(
        torch.optim.Adam,
        [{"lr": 0.01}],
        groups,
        6,
        lambda step: {"w", "b", "v", "s"} - ({"v"} if step in (2, 3) else set()),
    )
    assert not store.flat  # from step 2 on, shard by shard
    for name, param in reference.items():  # Adam's moments and step counts moved only when a gradient came
        for key, value in ref_opt.state[param].items():
            torch.testing.assert_close(store.shard_state(name)[key], value, rtol=1e-12, atol=0)


def test_an_optimizer_that_is_not_elementwise_sees_whole_shards():
    groups = {"w": 0, "b": 0, "v": 0, "s": 0}
    store, _, _ = _run(NormalizedSGD, [{"lr": 0.1, "momentum": 0.9}], groups, 3, lambda step: set(groups))
    assert not store.flat


def test_state_round_trips_and_disagreeing_step_counts_fall_back_to_shards():
    groups = {"w": 0, "b": 0, "v": 0, "s": 0}
    store, _, _ = _run(torch.optim.Adam, [{"lr": 0.01}], groups, 3, lambda step: set(groups))
    states = {name: {k: v.clone() for k, v in store.shard_state(name).items()} for name in store.shards}
    fresh = ShardStore(_values(), groups, torch.optim.Adam, [{"lr": 0.01}])
    fresh.load_state(states)
    assert fresh.flat
    for name in store.shards:
        for key, value in states[name].items():
            torch.testing.assert_close(fresh.shard_state(name)[key], value, rtol=0, atol=0)
    states["v"]["step"] = states["v"]["step"] + 1  # v has moved once more than the others
    fresh.load_state(states)
    assert not fresh.flat and torch.equal(fresh.shard_state("v")["step"], states["v"]["step"])


@st.composite
def flats(draw):
    """Parts of one dtype: some views that follow each other in one buffer, some on their own, small and large."""
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.int16, torch.bool]))
    sizes = draw(st.lists(st.sampled_from([0, 1, 3, 17, 9000, 40000]), min_size=1, max_size=8))
    shared = draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 1000)))

    def make(n):
        return torch.randint(0, 2, (n,), generator=g).to(dtype)

    buffer = make(sum(sizes))
    parts, start = [], 0
    for size, in_buffer in zip(sizes, shared):
        parts.append(buffer[start : start + size] if in_buffer else make(size))
        start += size
    return parts


@settings(max_examples=40, deadline=None)
@given(flats(), st.sampled_from([64, 4096, wire.CHUNK_BYTES]))
def test_flat_tensors_travel_as_one_and_land_in_their_parts(parts, chunk_bytes):
    message = wire.encode_chunks(
        "push", None, {"all": wire.Flat(parts), "one": torch.arange(3)}, chunk_bytes=chunk_bytes
    )
    assert torch.equal(wire.decode(wire.join_chunks(message))[2]["all"], torch.cat(parts))
    like_parts = [torch.empty(sum(p.numel() for p in parts), dtype=parts[0].dtype)]
    like_parts = list(torch.split(like_parts[0], [p.numel() for p in parts]))  # views in one buffer
    scattered = [torch.empty_like(p) for p in parts]
    for destination in (like_parts, scattered):
        got = wire.decode_into(message, {"all": wire.Flat(destination), "one": torch.empty(3, dtype=torch.int64)})
        assert got == ("push", None, ["all", "one"])
        for sent, received in zip(parts, destination):
            assert torch.equal(sent, received)


def test_flat_refuses_mixed_dtypes_and_destinations_it_cannot_write():
    with pytest.raises(
        wire.WireFormatError, match=r"must share one dtype. Received: \['torch.float32', 'torch.int64'\]"
    ):
        wire.Flat([torch.ones(2), torch.arange(2)])
    message = wire.encode_chunks("v", None, {"x": torch.ones(4)})
    with pytest.raises(
        wire.WireFormatError, match="contiguous CPU tensors that do not require grad. Received: .*contiguous: False"
    ):
        wire.decode_into(message, {"x": wire.Flat([torch.empty(2, 2).t()])})
    with pytest.raises(
        wire.WireFormatError,
        match=r"tensors do not match the destinations. Received: x torch.float32 "
        r"\[4\], destination torch.float32 \[5\] \(flat\)",
    ):
        wire.decode_into(message, {"x": wire.Flat([torch.empty(5)])})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shared_memory", [None, False], ids=["shared-memory", "grpc"])
def test_a_worker_copy_arranged_in_buckets_pulls_in_place_and_skips_unused_parameters(shared_memory):
    servers = [ParameterServer(security=SECURITY, task=f"ps:{i}") for i in range(2)]
    try:
        torch.manual_seed(0)
        model = torch.nn.ModuleDict(
            {"a": torch.nn.Linear(3, 4), "b": torch.nn.Linear(4, 2), "c": torch.nn.Linear(4, 2)}
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        reference = copy.deepcopy(model)
        ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05)
        shards = place([(n, p, 0) for n, p in model.named_parameters()], 2, None)
        variables = ShardedVariables(
            shards, [ps.address for ps in servers], security=SECURITY, rpc_timeout=20, shared_memory=shared_memory
        )
        variables.create(dict(model.named_parameters()), optimizer)
        worker = copy.deepcopy(model)
        params = dict(worker.named_parameters())
        variables.arrange(params)
        on_ps0 = [params[s.parameter] for s in shards if s.ps == 0]
        storage = {p.untyped_storage().data_ptr() for p in on_ps0}
        assert len(storage) == 1  # one buffer per bucket
        x = torch.randn(8, 3)
        for step in range(4):
            head = "b" if step % 2 else "c"  # each step leaves one head without a gradient
            for net, run in ((reference, None), (worker, variables)):
                if run is not None:
                    run.pull_into(params)
                net.zero_grad()
                net[head](torch.relu(net["a"](x))).square().mean().backward()
                if run is not None:
                    run.push({n: p.grad for n, p in params.items()})
                else:
                    ref_opt.step()
        variables.pull_into(params)
        for (name, got), want in zip(worker.named_parameters(), reference.parameters()):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
        assert {p.untyped_storage().data_ptr() for p in on_ps0} == storage  # pulls wrote in place
        variables.close()
    finally:
        for ps in servers:
            ps.stop()


def test_a_large_push_updates_each_segment_as_soon_as_its_gradient_is_in(monkeypatch):
    monkeypatch.setattr(store_module, "SEGMENT_BYTES", 64)  # a segment per 8 float64s: many per bucket
    values = {f"w{i}": torch.randn(4, 3, dtype=torch.float64) for i in range(6)}
    reference = {n: torch.nn.Parameter(v.clone()) for n, v in values.items()}
    ref_opt = torch.optim.Adam(reference.values(), lr=0.1)
    ps = ParameterServer(security=SECURITY)
    try:
        spec = optimizer_spec(ref_opt)
        _, meta, _ = ps._create("create", {"groups": {n: 0 for n in values}, "optimizer": spec}, values)
        assert len(ps._store.buckets[0].segments) == 6
        for step in range(3):
            grads = {n: torch.randn(4, 3, dtype=torch.float64) for n in values}
            pieces = wire.encode_chunks(
                "push", {"layout": meta["layout"]}, {"@0": wire.Flat(list(grads.values()))}, chunk_bytes=96
            )
            seen_early = []

            def arriving(pieces=pieces, seen_early=seen_early):
                before = ps._store.shards["w0"].detach().clone()
                for index, piece in enumerate(pieces):
                    if index == len(pieces) - 1:  # the last piece is not in yet: the first shard is updated already
                        seen_early.append(not torch.equal(ps._store.shards["w0"].detach(), before))
                    yield piece

            ps._push(arriving())
            for name, param in reference.items():
                param.grad = grads[name]
            ref_opt.step()
            assert seen_early == [True]
            for name, param in reference.items():
                torch.testing.assert_close(ps._store.shards[name].detach(), param.detach(), rtol=1e-12, atol=0)
    finally:
        ps.stop()


def test_staging_gathers_small_parts_into_a_kept_buffer_and_follows_new_shapes():
    staging = wire.Staging()
    big = torch.randn(wire.SMALL_PART_BYTES // 4 + 1)
    first = [torch.randn(3), torch.randn(2, 2), big, torch.randn(5)]
    blocks = wire.Flat(first, staging=staging).gather()
    assert [b.numel() for b in blocks] == [7, big.numel(), 5] and blocks[1].data_ptr() == big.data_ptr()
    assert torch.equal(torch.cat(blocks), torch.cat([p.reshape(-1) for p in first]))
    kept = blocks[0].untyped_storage().data_ptr()
    second = [torch.randn(3), torch.randn(2, 2), big, torch.randn(5)]  # same shapes: the same buffer
    again = wire.Flat(second, staging=staging).gather()
    assert again[0].untyped_storage().data_ptr() == kept
    assert torch.equal(torch.cat(again), torch.cat([p.reshape(-1) for p in second]))
    other = [torch.randn(4), torch.randn(1)]  # new shapes: a new layout
    assert torch.equal(torch.cat(wire.Flat(other, staging=staging).gather()), torch.cat(other))
