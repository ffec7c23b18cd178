"""A tensor handed to `strategy.run` that nothing cut reaches every replica whole; run says so once per argument,
naming it and the fix, unless it was marked with `sg.replicated` (issue 29, item 3, second half)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import cpu_registry

import stratagem as sg


def mirrored(n: int = 2) -> sg.MirroredStrategy:
    return sg.MirroredStrategy([f"cpu:{i}" for i in range(n)], registry=cpu_registry(3))


def shapes_seen(strategy: sg.Strategy, *args: torch.Tensor, **kwargs: torch.Tensor) -> list[tuple[int, ...]]:
    result = strategy.run(lambda *a, **k: torch.tensor((a or tuple(k.values()))[0].shape), args=args, kwargs=kwargs)
    return [tuple(t.tolist()) for t in strategy.experimental_local_results(result)]


def test_a_whole_tensor_is_named_once_with_the_fix() -> None:
    strategy = mirrored()
    batch = torch.zeros(6, 3)
    with pytest.warns(UserWarning) as caught:
        seen = shapes_seen(strategy, batch)
    assert seen == [(6, 3), (6, 3)]  # every replica received the whole batch: the case the warning is about
    (warning,) = [w for w in caught if "strategy.run received" in str(w.message)]
    message = str(warning.message)
    assert "strategy.run received args[0], a tensor of shape (6, 3)" in message
    assert "each of the 2 replicas receives it whole" in message
    assert "strategy.distribute_dataset(loader)" in message and "sg.replicated(tensor)" in message
    assert warning.filename == __file__  # it points at the user's call of run
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shapes_seen(strategy, batch)  # once per argument: the second step says nothing
    with pytest.warns(UserWarning, match=r'strategy.run received kwargs\["x"\], a tensor of shape \(6, 3\)'):
        shapes_seen(strategy, x=batch)
    strategy.close()


@pytest.mark.parametrize(
    "make", [lambda: sg.OneDeviceStrategy("cpu"), lambda: mirrored(1)], ids=["one-device", "mirrored-1"]
)
def test_one_replica_is_not_warned(make) -> None:
    strategy = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shapes_seen(strategy, torch.zeros(6, 3))
    strategy.close()


def test_cut_marked_and_scalar_tensors_are_not_warned() -> None:
    strategy = mirrored(3)
    weights = sg.replicated(torch.ones(3))
    (x,) = list(strategy.distribute_dataset([torch.zeros(6, 3)]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert shapes_seen(strategy, x) == [(2, 3)] * 3
        assert shapes_seen(strategy, weights) == [(3,)] * 3
        strategy.run(lambda lr: lr * 2, args=(torch.tensor(0.1),))
        assert strategy.step(lambda t: t.sum(), returns="sum")(torch.ones(6, 3)).item() == 18.0
    assert sg.replicated({"w": weights}) == {"w": weights}  # a nest comes back as it was
    strategy.close()
