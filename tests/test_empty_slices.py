"""Replicas whose slice is empty (a global batch smaller than the replica count): the user's model is
never called on an empty batch, the replica still takes part in every collective with weight zero,
and every replica ends each step with one device's parameters and optimizer state."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from cases import TOL
from conftest import cpu_registry
from torch import nn

import stratagem as sg

SIZES = [2, 1, 4, 2]  # over 3 replicas: slices (1, 1, 0), (1, 0, 0), (2, 1, 1), (1, 1, 0)


class FlattenNet(nn.Module):
    """A conv net with the classic view-flatten, which raises on a batch of 0 examples; it notes each batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(
            2, 3, 3, padding=1, bias=False
        )  # before BatchNorm a bias gets only rounding noise, which Adam amplifies
        self.norm = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 4 * 4, 4)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.size(0))
        h = F.relu(self.norm(self.conv(x)))
        return self.fc(h.view(h.size(0), -1))


class LossInside(nn.Module):
    """A model that computes its loss itself when given labels (as Hugging Face models do)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        self.seen.append(x.size(0))
        logits = self.body(x)
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


def data(sizes=SIZES, shape=(2, 4, 4), classes=4):
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn((n, *shape), generator=g, dtype=torch.float64), torch.randint(0, classes, (n,), generator=g))
        for n in sizes
    ]


def fresh(factory=FlattenNet):
    torch.manual_seed(11)
    model = factory().double()
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def train_plain(model, optimizer, batches):
    for x, y in batches:
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()


def strategy_of(kind: str) -> sg.Strategy:
    devices = ["cpu:0", "cpu:1", "cpu:2"]
    if kind == "central-in-place":
        return sg.CentralStorageStrategy(devices, registry=cpu_registry(3))
    if kind == "central-copies":
        return sg.CentralStorageStrategy(devices, share_parameters=False, registry=cpu_registry(3))
    return sg.MirroredStrategy(
        devices, share_parameters={"shared": None, "copies": False}[kind], registry=cpu_registry(3)
    )


@pytest.mark.parametrize("kind", ["shared", "copies", "central-in-place", "central-copies"])
def test_idle_replicas_never_call_the_model_on_an_empty_batch_and_end_like_one_device(kind):
    reference, ref_opt = fresh()
    train_plain(reference, ref_opt, data())
    model, opt = fresh()
    strategy = strategy_of(kind)
    model, opt = strategy.distribute(model, opt)

    def step(x, y):
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # the combined gradient, on the idle replica too
        optimizer_step()
        return out

    def optimizer_step():
        opt.step()
        opt.zero_grad()

    outputs = [strategy.run(step, args=batch) for batch in strategy.distribute_dataset(data())]
    for replica in model.replicas:
        assert 0 not in replica.seen
    assert [tuple(o.shape) for o in strategy.experimental_local_results(outputs[1])] == [(1, 4), (0, 4), (0, 4)]
    want = reference.state_dict()
    trained = [model.central] if kind.startswith("central") else model.replicas
    for module in trained:
        for key, value in want.items():
            torch.testing.assert_close(module.state_dict()[key], value, **TOL[torch.float64])
    states = [opt.state_dict()] if kind != "copies" else [o.state_dict() for o in opt._optimizers]
    for state in states:  # private copies: every replica's own optimizer, the idle ones' included
        for index, entry in ref_opt.state_dict()["state"].items():
            for name in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(state["state"][index][name], entry[name], **TOL[torch.float64])
    strategy.close()


def test_a_loss_the_model_computes_itself_is_zero_on_an_idle_replica():
    reference, ref_opt = fresh(LossInside)
    batches = data(sizes=[2, 4], shape=(5,), classes=3)
    for x, y in batches:
        reference(x, labels=y)["loss"].backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model, opt = fresh(LossInside)
    strategy = strategy_of("copies")
    model, opt = strategy.distribute(model, opt)

    def step(x, y):
        out = model(x, labels=y)
        out["loss"].backward()
        opt.step()
        opt.zero_grad()
        return out

    results = [strategy.run(step, args=batch) for batch in strategy.distribute_dataset(batches)]
    first = results[0]
    assert [float(v.detach()) for v in strategy.experimental_local_results(first["loss"])][2] == 0.0
    assert tuple(strategy.experimental_local_results(first["logits"])[2].shape) == (0, 3)
    for replica in model.replicas:
        assert 0 not in replica.seen
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(replica.state_dict()[key], value, **TOL[torch.float64])
    strategy.close()


def test_explain_says_what_an_idle_replica_does():
    text = str(strategy_of("shared").explain())
    assert (
        "empty slices: a replica whose slice is empty runs the step function as the others do, but the model runs "
        "on a one-example stand-in batch" in text
    )
    assert "takes part in every collective with weight zero" in text
    assert "empty slices" not in str(sg.MirroredStrategy(["cpu:0"], registry=cpu_registry(1)).explain())


def test_an_input_that_requires_grad_keeps_every_replica_in_the_same_backward():
    # BatchNorm on the input itself: its backward exchange happens only when the input needs a gradient,
    # so the idle replica's stand-in must need one too.
    torch.manual_seed(2)
    reference = nn.Sequential(nn.BatchNorm1d(5), nn.Linear(5, 3)).double()
    model = copy.deepcopy(reference)
    ((x, y),) = data(sizes=[2], shape=(5,), classes=3)
    leaf = x.clone().requires_grad_()
    F.cross_entropy(reference(leaf), y).backward()
    strategy = strategy_of("copies")
    model = strategy.distribute(model)

    def step(x, y):
        x = x.clone().requires_grad_()
        F.cross_entropy(model(x), y).backward()
        return x.grad

    ((px, py),) = strategy.distribute_dataset([(x, y)])
    grads = strategy.experimental_local_results(strategy.run(step, args=(px, py)))
    # A replica's input gradient is that of its own loss (the mean over its slice), half the global batch here.
    torch.testing.assert_close(torch.cat(grads[:2]), 2 * leaf.grad, **TOL[torch.float64])
    assert tuple(grads[2].shape) == (0, 5)
    for got, want in zip(model.replicas[2].parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, **TOL[torch.float64])
    strategy.close()


class BatchSecond(nn.Module):
    """Outputs (heads, batch, classes), as a stack of heads or a sequence model without batch_first gives."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(5, 3) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([head(x) for head in self.heads])


def test_an_output_whose_batch_is_not_its_first_dimension_is_cut_there():
    torch.manual_seed(3)
    reference = BatchSecond().double()
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    batches = data(sizes=[2, 4], shape=(5,), classes=3)

    def loss_of(out, y):
        return sum(F.cross_entropy(head, y) for head in out)

    for x, y in batches:
        loss_of(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    strategy = strategy_of("copies")
    model, opt = strategy.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def step(x, y):
        out = model(x)
        loss_of(out, y).backward()
        opt.step()
        opt.zero_grad()
        return out

    first, _ = [strategy.run(step, args=batch) for batch in strategy.distribute_dataset(batches)]
    assert [tuple(o.shape) for o in strategy.experimental_local_results(first)] == [(2, 1, 3), (2, 1, 3), (2, 0, 3)]
    for replica in model.replicas:
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(replica.state_dict()[key], value, **TOL[torch.float64])
    strategy.close()
