"""Random draws inside the step on logical CPU replicas repeat from run to run (issue 27, item 8).

The replicas of one CPU are threads sharing torch's one CPU generator; before, their dropout masks came from
it in the order the threads ran, so two runs with one seed differed. Each replica but the first now draws from
its own generator seeded from the base seed (strategies/data_parallel/cpu_threads/replica_random.py). The tests force the
threads to interleave differently in each run (a random pause, from an unseeded Python generator, between
the dropout layers), so that without per-replica generators the runs differ."""

from __future__ import annotations

import random
import time

import pytest
import torch
from conftest import cpu_registry
from torch import nn

import stratagem as sg
from stratagem.strategies.data_parallel.cpu_threads.replica_random import ReplicaRandom, ReplicaRandomPart
from stratagem.strategies.data_parallel.step_part import Built, RunState

_jitter = random.Random()  # seeded from the OS: the interleaving differs from run to run


class Pause(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(_jitter.random() * 0.004)
        return x


def _model() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(8, 8), nn.Dropout(0.5), Pause()]
    return nn.Sequential(*layers, nn.Linear(8, 1)).double()


STRATEGIES = {
    "mirrored-2": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(3)),
    "mirrored-3": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3)),
    "mirrored-3-copies": lambda: sg.MirroredStrategy(
        ["cpu:0", "cpu:1", "cpu:2"], share_parameters=False, registry=cpu_registry(3)
    ),
    "central-2": lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(3)),
}


def _train(name: str, steps: int = 8) -> list[torch.Tensor]:
    torch.manual_seed(5)
    strategy = STRATEGIES[name]()
    try:
        model = _model()
        model, optimizer = strategy.distribute(model, torch.optim.SGD(model.parameters(), lr=0.05))
        data = torch.Generator().manual_seed(2)
        for _ in range(steps):
            x = torch.randn(12, 8, generator=data, dtype=torch.float64)

            def step(x: torch.Tensor) -> torch.Tensor:
                optimizer.zero_grad()
                loss = model(x).pow(2).mean() + torch.rand(1, dtype=torch.float64).sum() * 0  # a draw of its own
                loss.backward()
                optimizer.step()
                return loss

            strategy.run(step, (x,))
        return [p.detach().clone() for p in model.parameters()]
    finally:
        strategy.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_two_runs_with_one_seed_are_bit_identical(name: str) -> None:
    first = _train(name)
    for _ in range(2):
        again = _train(name)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), "a rerun with the same seed differs"


@pytest.mark.timeout(60)
def test_each_replica_draws_its_own_stream_and_replica_0_draws_torchs() -> None:
    strategy = STRATEGIES["mirrored-2"]()
    try:
        # A model with dropout: the per-replica streams are on from the first step. (A model that draws nothing
        # runs its first step without them, so its replicas would draw from torch's generator in thread order.)
        model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
        torch.manual_seed(11)
        strategy.distribute(model)
        masks = strategy.experimental_local_results(
            strategy.run(lambda: torch.nn.functional.dropout(torch.ones(64, dtype=torch.float64), 0.5))
        )
        assert not torch.equal(masks[0], masks[1]), "two replicas drew the same mask"
        torch.manual_seed(11)  # replica 0 drew torch's own first mask after the seed
        assert torch.equal(masks[0], torch.nn.functional.dropout(torch.ones(64, dtype=torch.float64), 0.5))
        decisions = {d.subject: d.choice for d in strategy.explain().decisions}
        assert decisions["CPU random streams"] == "one per replica"
    finally:
        strategy.close()


def test_the_mode_hands_its_generator_to_random_operators_and_leaves_a_given_one() -> None:
    generator = torch.Generator().manual_seed(3)
    with ReplicaRandom(generator):
        drawn = [
            torch.rand(4),
            torch.randn(4),
            torch.randint(0, 100, (4,)),
            torch.randperm(6),
            torch.ones(64).bernoulli_(0.5),
        ]
        mine = torch.Generator().manual_seed(9)
        given = torch.rand(4, generator=mine)
    expected_generator = torch.Generator().manual_seed(3)
    expected = [
        torch.rand(4, generator=expected_generator),
        torch.randn(4, generator=expected_generator),
        torch.randint(0, 100, (4,), generator=expected_generator),
        torch.randperm(6, generator=expected_generator),
        torch.ones(64).bernoulli_(0.5, generator=expected_generator),
    ]
    for a, b in zip(drawn, expected):
        assert torch.equal(a, b)
    assert torch.equal(given, torch.rand(4, generator=torch.Generator().manual_seed(9)))


def _part_after_steps(model: nn.Module, draws: list[bool]) -> tuple[ReplicaRandomPart, list[bool]]:
    """A replica-random part for 2 CPU replicas, run through steps that draw on replica 1 (or not); returns
    the part and whether its mode was on in each step."""
    part = ReplicaRandomPart([torch.device("cpu"), torch.device("cpu")], lambda: 0)
    part.prepare(Built([model, model], model, None, []), [])
    on = []
    for step, draw in enumerate(draws, start=1):
        state = RunState(step, [0.5, 0.5])
        part.begin_step(state)
        context = part.random(1)
        on.append(isinstance(context, ReplicaRandom))
        with context:
            if draw:
                torch.rand(3)
        part.end_run(state)
    return part, on


def test_the_mode_stays_off_where_nothing_draws_and_comes_back_with_a_warning(caplog) -> None:
    _, on = _part_after_steps(nn.Linear(2, 2), [False, False, False])
    assert on == [False, False, False]  # a model that draws nothing never runs under the mode
    with caplog.at_level("WARNING", logger="stratagem.strategies.data_parallel.cpu_threads.replica_random"):
        _, on = _part_after_steps(nn.Linear(2, 2), [False, False, True, True])
    assert on == [False, False, False, True]  # step 3 drew from torch's generator: from step 4 on
    assert "Step 3 drew random numbers from torch's CPU generator" in caplog.text
    _, on = _part_after_steps(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)), [False, False])
    assert on == [True, True]  # a model with dropout: always
    _, on = _part_after_steps(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0)), [False, False])
    assert on == [False, False]  # dropout with p=0 draws nothing


def test_a_foreach_update_under_the_mode_moves_version_counters_as_outside_it() -> None:
    # torch leaves a foreach operator's in-place list unversioned under a dispatch mode; autograd's check of saved
    # tensors and the hand-written-update watch read those counters, so the mode moves them itself.
    p, q = torch.zeros(3), torch.zeros(2)
    with torch.no_grad(), ReplicaRandom(torch.Generator()):
        torch._foreach_add_([p, q], 1.0)
    assert (p._version, q._version) == (1, 1)
