"""A parameter update written by hand in the step function (`p.data.add_`, `p -= lr * p.grad` under no_grad,
`torch._foreach_add_`) counts once per global step under every synchronous strategy, or is refused naming
the parameter: never once per replica (issue 27, item 4). Expected values: the same script on one device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_registry
from hand_update_cases import WAYS, batches, make_model, train, update
from helpers import launch_workers

import stratagem as sg

STRATEGIES = {
    "one-device": lambda: sg.OneDeviceStrategy("cpu"),
    "mirrored-1": lambda: sg.MirroredStrategy(["cpu:0"], registry=cpu_registry(3)),
    "mirrored-2": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(3)),
    "mirrored-3": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3)),
    "central-2": lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(3)),
    "central-2-copies": lambda: sg.CentralStorageStrategy(
        ["cpu:0", "cpu:1"], share_parameters=False, registry=cpu_registry(3)
    ),
}


def assert_same(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=1e-12, msg=key)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_hand_written_update_counts_once_per_step(name: str, way: str) -> None:
    expected, expected_losses = train(None, way)
    strategy = STRATEGIES[name]()
    try:
        state, losses = train(strategy, way)
    finally:
        strategy.close()
    assert_same(state, expected)
    assert losses == pytest.approx(expected_losses, rel=1e-12)


def test_without_an_optimizer_logical_replicas_keep_a_copy_each_and_say_why() -> None:
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    model = strategy.distribute(make_model())
    decision = strategy.explain().decision("parameter storage")
    assert decision.choice == "a private copy per replica"
    assert "no optimizer was given to distribute()" in decision.reason
    first, second = model.replicas
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(first.parameters(), second.parameters()))
    strategy.close()


def test_central_storage_without_an_optimizer_says_its_replicas_update_a_copy() -> None:
    strategy = sg.CentralStorageStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    strategy.distribute(make_model())
    decision = strategy.explain().decision("parameter copies")
    assert decision.choice == "one per step to 1 replica(s)"
    assert "no optimizer was given to distribute()" in decision.reason
    strategy.close()


REFUSED = {
    "mirrored-2": (STRATEGIES["mirrored-2"], "share one copy of the parameters.*applied it 2 times"),
    "central-2": (STRATEGIES["central-2"], "applies once per replica"),
    "central-2-copies": (STRATEGIES["central-2-copies"], "overwritten at the next step"),
}


@pytest.mark.parametrize("way", ["no_grad_sub", "foreach"])
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_hand_written_update_beside_the_optimizer_is_refused_at_the_first_step(name: str, way: str) -> None:
    make, consequence = REFUSED[name]
    strategy = make()
    start = make_model()
    model, optimizer = strategy.distribute(start, torch.optim.SGD(start.parameters(), lr=0.1))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        update(model, way)  # e.g. a weight decay written by hand
        return loss.detach()

    x, y = batches()[0]
    with pytest.raises(
        sg.InputError,
        match=f"Parameter '0.weight' was changed in place.*{consequence}.*Received: "
        r"an in-place change of '0.weight' \(shape \(6, 4\)\)\. Update the parameters only through",
    ):
        strategy.step(step)(x, y)
    strategy.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_hand_written_update_counts_once_across_two_workers(tmp_path) -> None:
    out = tmp_path / "result.pt"
    exit_code, output = launch_workers("mwms_hand_updates.py", {"MW_OUT": str(out)}, timeout=280)
    assert exit_code == 0, output
    saved = torch.load(out)
    for way, local in [*((way, 1) for way in WAYS), ("data_add", 2)]:
        expected, expected_losses = train(None, way)
        state, losses = saved[(way, local)]
        assert_same(state, expected)
        assert losses == pytest.approx(expected_losses, rel=1e-12), (way, local)
