"""Replica copies that would share state with the original (issue 27, item 5).

A model that keeps a function closing over its own submodule (minGPT's `self.mlpf = lambda x: ...`), a bound
method of a submodule, or a plain attribute referring to a submodule, trains under Mirrored and CentralStorage
as on one device: each replica copy calls its own submodules. What cannot be mapped is refused at
`distribute`, naming the attribute and the submodule. Before, the lambda made every copy call replica 0's
submodule and Mirrored x2 waited out its timeout at the first end of backward."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from in_process_strategies import STRATEGIES
from torch import nn

import stratagem as sg
from stratagem.strategies.data_parallel.replica_copy import copy_replica
from stratagem.strategies.data_parallel.replicas import ReplicaBarrier


class Block(nn.Module):
    """A minGPT-style block whose MLP is reached in one of several ways (`kind`)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(4)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(4, 8), "c_proj": nn.Linear(8, 4)})
        m = self.mlp
        self.kind = kind
        if kind == "lambda":  # minGPT's exact idiom
            self.mlpf = lambda x: m.c_proj(F.gelu(m.c_fc(x)))
        elif kind == "nested":  # a closure over self, and a lambda in a list calling another
            inner = lambda x: self.mlp.c_fc(x)  # noqa: E731 - the idiom under test
            self.steps = [lambda x: m.c_proj(F.gelu(inner(x)))]
        elif kind == "method":
            self.fc = self.mlp.c_fc.forward
            self.proj = self.mlp.c_proj.forward
        elif kind == "attribute":  # a plain reference, kept out of the registered submodules
            object.__setattr__(self, "ref", self.mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        if self.kind == "lambda":
            return x + self.mlpf(h)
        if self.kind == "nested":
            return x + self.steps[0](h)
        if self.kind == "method":
            return x + self.proj(F.gelu(self.fc(h)))
        return x + self.ref.c_proj(F.gelu(self.ref.c_fc(h)))


def _train(kind: str, strategy: sg.Strategy | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(Block(kind), nn.Linear(4, 2)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if strategy is not None:
        model, optimizer = strategy.distribute(model, optimizer)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(6, 4, generator=generator, dtype=torch.float64)

        def step(x: torch.Tensor) -> torch.Tensor:
            optimizer.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            return loss

        if strategy is None:
            step(x)
        else:
            strategy.run(step, (x,))
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["lambda", "nested", "method", "attribute"])
@pytest.mark.parametrize("name", ["mirrored-2", "mirrored-3-copies", "central-3"])
def test_a_model_reaching_its_submodule_trains_as_on_one_device(kind: str, name: str) -> None:
    reference = _train(kind, None)
    strategy = STRATEGIES[name]()
    try:
        got = _train(kind, strategy)
    finally:
        strategy.close()
    for mine, theirs in zip(got, reference):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_the_copy_of_a_lambda_calls_the_copys_submodule() -> None:
    original = Block("lambda")
    clone = copy_replica(original)
    assert clone.mlpf is not original.mlpf
    with torch.no_grad():
        clone.mlp.c_proj.bias.add_(1.0)
    x = torch.randn(3, 4)
    # Only the copy changed, and only the copy's lambda sees the change.
    torch.testing.assert_close(clone.mlpf(x), original.mlpf(x) + 1.0)
    # The plain deep copy keeps the original's submodule (why replicas need copy_replica).
    assert copy.deepcopy(original).mlpf.__closure__[0].cell_contents is original.mlp


def test_a_module_held_past_registration_is_refused_with_its_attribute() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    object.__setattr__(model[0], "aux", nn.Linear(4, 4))
    with pytest.raises(sg.ReplicaError, match=r"attribute `0\.aux` holds a Linear with 20 parameter values"):
        copy_replica(model)
    strategy = STRATEGIES["mirrored-2"]()
    try:
        with pytest.raises(sg.ReplicaError, match=r"Register it \(`self\.aux = module`\)"):
            strategy.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
    finally:
        strategy.close()


SHARED_MODEL: nn.Module | None = None
SHARED_LAYER: list[nn.Module] = []


def _through_global(x: torch.Tensor) -> torch.Tensor:
    assert SHARED_MODEL is not None
    return SHARED_MODEL[0](x)


def _through_submodule_global(x: torch.Tensor) -> torch.Tensor:
    return SHARED_LAYER[0](x)


def test_a_function_reaching_the_model_through_a_global_is_refused_with_names() -> None:
    global SHARED_MODEL
    model = nn.Sequential(nn.Linear(4, 4))
    model.f = _through_global  # a plain attribute: nn.Module keeps a function in __dict__
    SHARED_MODEL = model
    SHARED_LAYER.append(model[0])
    try:
        with pytest.raises(
            sg.ReplicaError, match=r"attribute `f`.*reaches the model itself through the global `SHARED"
        ):
            copy_replica(model)
        model.f = _through_submodule_global
        with pytest.raises(
            sg.ReplicaError, match=r"reaches the model's submodule `0` through the global `SHARED_LAYER`"
        ):
            copy_replica(model)
    finally:
        SHARED_MODEL = None
        SHARED_LAYER.clear()


@pytest.mark.timeout(30)
def test_a_replica_reaching_a_meeting_twice_is_named_once_with_the_missing_one() -> None:
    barrier = ReplicaBarrier(["cpu:0", "cpu:1"], timeout=20.0)
    errors: list[BaseException] = []
    arrived = threading.Event()

    def waiting() -> None:
        arrived.set()  # called while replica 0 waits there, after it arrived

    def first() -> None:
        try:
            barrier.wait(0, "end of backward", 1, steal=lambda: waiting())
        except BaseException as error:  # noqa: BLE001 - looked at below
            errors.append(error)

    thread = threading.Thread(target=first)
    thread.start()
    assert arrived.wait(10)
    with pytest.raises(sg.ReplicaError) as raised:
        barrier.wait(0, "end of backward", 1)
    thread.join(timeout=10)
    message = str(raised.value)
    assert "Replica 0 (cpu:0) reached the end of backward of step 1 a second time" in message
    assert "replica 1 (cpu:1) never did" in message
    assert "but replica 0" not in message
    assert errors, "the first waiter gave up with the error instead of waiting out the timeout"
