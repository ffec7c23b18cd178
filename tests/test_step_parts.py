"""The replica set's parts and the protocol of its host: a set combines gradients only through a part, and
what runs inside replicas reaches the set through `ReplicaHost` alone."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from conftest import cpu_registry
from torch import nn

import stratagem as sg
from stratagem.strategies.data_parallel.combine import choose_local_combine
from stratagem.strategies.data_parallel.host import ReplicaHost
from stratagem.strategies.data_parallel.mirrored_replicas import MirroredReplicas
from stratagem.strategies.data_parallel.placement import place_replicas
from stratagem.strategies.data_parallel.replica_set import ReplicaSet
from stratagem.strategies.data_parallel.set_parts import LocalCombinationPart, LossWeights
from stratagem.strategies.data_parallel.step_part import StepPart


def _set(strategy: sg.MirroredStrategy, *, combine: bool) -> ReplicaSet:
    placement = place_replicas(["cpu:0", "cpu:1"], require_gpu=False, registry=cpu_registry(2), intra_op_threads=1)
    return ReplicaSet(
        strategy,
        placement,
        build=MirroredReplicas(share_parameters=False),
        combine=choose_local_combine(placement.devices, nccl_available=False) if combine else None,
        batch_norm="global",
        timeout=60.0,
    )


def _slice_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    reference = copy.deepcopy(model)
    F.mse_loss(reference(x), y).backward()
    return reference.weight.grad.clone()


def test_a_set_without_a_combining_part_leaves_each_replicas_gradient_its_own() -> None:
    # A strategy whose library sums gradients itself (FSDP's reduce-scatter) gives its set no combining part.
    torch.manual_seed(0)
    model = nn.Linear(3, 1, bias=False)
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    expected = [_slice_gradient(model, x[:2], y[:2]), _slice_gradient(model, x[2:], y[2:])]
    strategy = sg.MirroredStrategy(["cpu:0"], registry=cpu_registry(1))  # names the replicas' strategy only
    replica_set = _set(strategy, combine=False)
    try:
        assert not any(isinstance(p, (LocalCombinationPart, LossWeights)) for p in replica_set.step_parts)
        distributed = replica_set.distribute(model, None)

        def step(xs: torch.Tensor, ys: torch.Tensor) -> None:
            F.mse_loss(distributed(xs), ys).backward()

        replica_set.run(
            step,
            args=(sg.PerReplica((x[:2], x[2:]), batch_sizes=(2, 2)), sg.PerReplica((y[:2], y[2:]), batch_sizes=(2, 2))),
        )
        grads = [params[0].grad for params in replica_set.replica_params]
        assert not torch.allclose(expected[0], expected[1])  # the slices' gradients differ: a sum would show
        torch.testing.assert_close(grads[0], expected[0])
        torch.testing.assert_close(grads[1], expected[1])
    finally:
        replica_set.close()
        strategy.close()


def test_a_set_with_the_combining_part_gives_every_replica_the_global_gradient() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1, bias=False)
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    expected = _slice_gradient(model, x, y)  # one device, the whole batch
    strategy = sg.MirroredStrategy(["cpu:0"], registry=cpu_registry(1))
    replica_set = _set(strategy, combine=True)
    try:
        assert any(isinstance(p, LocalCombinationPart) for p in replica_set.step_parts)
        distributed = replica_set.distribute(model, None)

        def step(xs: torch.Tensor, ys: torch.Tensor) -> None:
            F.mse_loss(distributed(xs), ys).backward()

        replica_set.run(
            step,
            args=(sg.PerReplica((x[:2], x[2:]), batch_sizes=(2, 2)), sg.PerReplica((y[:2], y[2:]), batch_sizes=(2, 2))),
        )
        for params in replica_set.replica_params:
            torch.testing.assert_close(params[0].grad, expected)
    finally:
        replica_set.close()
        strategy.close()


def test_every_step_part_member_does_nothing_unless_a_part_defines_it() -> None:
    class Counting(StepPart):
        def __init__(self) -> None:
            self.steps = 0

        def begin_step(self, state: object) -> None:  # type: ignore[override]
            self.steps += 1

    part = Counting()
    part.begin_step(None)
    part.end_run(None)  # type: ignore[arg-type]
    part.close()
    assert (part.steps, part.decisions(), part.details(), part.acts_on_gradients) == (1, [], {}, False)


def test_the_distributed_model_and_optimizer_reach_their_host_through_the_protocol() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], share_parameters=False, registry=cpu_registry(2))
    try:
        net = nn.Linear(2, 1)
        model, optimizer = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1))
        host = model._host
        assert isinstance(host, ReplicaHost) and host.strategy is strategy and host.num_local_replicas == 2
        assert optimizer._host is host
        seen = strategy.run(lambda: torch.tensor(float(host.current_replica())))
        assert [float(v) for v in seen.values] == [0.0, 1.0]
        assert host.current_replica() is None  # outside run
    finally:
        strategy.close()
