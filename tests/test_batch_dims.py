"""The batch dimension of a step's inputs can be named (issue 27, item 7): `(seq, batch)` inputs and an LSTM's
carried `(layers, batch, hidden)` state are cut along the batch, and an argument whose size along its batch
dimension differs from the batch's is refused, never cut silently. Expected values: the same loop on one device."""

from __future__ import annotations

import pytest
import torch
from conftest import cpu_registry
from helpers import launch_workers
from seq_batch_cases import BATCH, HIDDEN, init_hidden, train, train_from_dataset

import stratagem as sg

STRATEGIES = {
    "one-device": lambda: sg.OneDeviceStrategy("cpu"),
    "mirrored-1": lambda: sg.MirroredStrategy(["cpu:0"], registry=cpu_registry(3)),
    "mirrored-2": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(3)),
    "mirrored-3": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3)),
    "central-2": lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(3)),
}


def assert_same(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=1e-12, msg=key)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_seq_batch_inputs_and_a_carried_hidden_state_train_as_one_device(name: str) -> None:
    expected, expected_losses = train(None)
    strategy = STRATEGIES[name]()
    try:
        state, losses = train(strategy)
    finally:
        strategy.close()
    assert_same(state, expected)
    assert losses == pytest.approx(expected_losses, rel=1e-12)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_seq_batch_batches_from_distribute_dataset_train_as_one_device(name: str) -> None:
    expected, expected_losses = train_from_dataset(None)
    strategy = STRATEGIES[name]()
    try:
        state, losses = train_from_dataset(strategy)
    finally:
        strategy.close()
    assert_same(state, expected)
    assert losses == pytest.approx(expected_losses, rel=1e-12)


def test_each_replica_receives_its_columns_and_keeps_its_state() -> None:
    strategy = STRATEGIES["mirrored-3"]()
    data = torch.arange(2 * BATCH).reshape(2, BATCH)  # (seq, batch): column b holds b and BATCH + b

    @strategy.step(batch_dims={"data": 1, "hidden": 1}, returns="per_replica")
    def step(data: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return data.clone(), hidden + data[0].unsqueeze(0)

    pieces, hidden = step(data, torch.zeros(1, BATCH, dtype=torch.long))
    assert [p.tolist() for p in pieces.values] == [[[0, 1, 2], [7, 8, 9]], [[3, 4], [10, 11]], [[5, 6], [12, 13]]]
    _, hidden = step(data, hidden)  # handed back: each replica gets its own state, uncut
    assert [h.tolist() for h in hidden.values] == [[[0, 2, 4]], [[6, 8]], [[10, 12]]]
    strategy.close()


def test_an_argument_of_another_size_along_its_batch_dimension_is_refused_naming_it() -> None:
    strategy = STRATEGIES["mirrored-2"]()
    step = strategy.step(lambda data, hidden: data.sum(), batch_dims={"data": 1, "hidden": 1})
    wrong = torch.zeros(1, BATCH - 1, HIDDEN)
    with pytest.raises(
        sg.InputError,
        match=r"hidden does not hold the batch's number of examples.*Received: hidden of shape \(1, 6, 4\) holds 6 "
        r"along dimension 1, and the batch holds 7 \(data of shape \(5, 7\) along dimension 1\)\. Name each "
        r"argument's batch dimension with batch_dims",
    ):
        step(torch.zeros(5, BATCH), wrong)
    # Without batch_dims the (layers, batch, hidden) state disagrees with the batch along dimension 0: refused too.
    plain = strategy.step(lambda data, hidden: data.sum())
    with pytest.raises(sg.InputError, match=r"hidden\[0\] of shape \(1, 7, 4\) holds 1 along dimension 0"):
        plain(torch.zeros(BATCH, 5), init_hidden())
    strategy.close()


def test_batch_dims_that_are_not_ints_or_name_no_argument_are_refused() -> None:
    strategy = STRATEGIES["one-device"]()
    with pytest.raises(sg.InputError, match=r"Received: batch_dims='1'\. For example batch_dims=1"):
        strategy.step(batch_dims="1")
    with pytest.raises(sg.InputError, match=r"Received: \['hiden'\] for a function of \(data, hidden\)"):
        strategy.step(lambda data, hidden: None, batch_dims={"hiden": 1})
    step = strategy.step(lambda data: data, batch_dims=2)
    with pytest.raises(sg.InputError, match=r"data has no dimension 2 to cut among replicas. Received: shape \(3, 4\)"):
        step(torch.zeros(3, 4))
    with pytest.raises(sg.InputError, match=r"batch_dim is the dimension .* Received: batch_dim=\(1,\)"):
        strategy.distribute_dataset([torch.zeros(2, 3)], batch_dim=(1,))  # type: ignore[arg-type]
    strategy.close()


@pytest.mark.parametrize("name", ["one-device", "mirrored-2", "mirrored-3"])
def test_distribute_dataset_cuts_along_the_named_batch_dimension(name: str) -> None:
    strategy = STRATEGIES[name]()
    batch = (torch.arange(2 * BATCH).reshape(2, BATCH), torch.arange(BATCH).reshape(1, BATCH, 1))
    (x, y), *rest = list(strategy.distribute_dataset([batch], batch_dim=1))
    assert rest == []
    xs, ys = strategy.experimental_local_results(x), strategy.experimental_local_results(y)
    assert torch.equal(torch.cat(xs, dim=1), batch[0]) and torch.equal(torch.cat(ys, dim=1), batch[1])
    assert all(p.shape[0] == 2 for p in xs)
    mean = strategy.reduce("mean", strategy.run(lambda a, b: a.double().mean(), args=(x, y)))
    assert float(mean) == pytest.approx(float(batch[0].double().mean()))
    with pytest.raises(sg.InputError, match=r"batch\[1\] of shape \(1, 6, 1\) holds 6 along dimension 1"):
        next(iter(strategy.distribute_dataset([(batch[0], batch[1][:, :6])], batch_dim=1)))
    strategy.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_seq_batch_inputs_train_as_one_device_across_two_workers(tmp_path) -> None:
    out = tmp_path / "result.pt"
    exit_code, output = launch_workers("mwms_batch_dims.py", {"MW_OUT": str(out)}, timeout=280)
    assert exit_code == 0, output
    saved = torch.load(out)
    for way, plain in {"step": train, "dataset": train_from_dataset}.items():
        expected, expected_losses = plain(None)
        for local in (1, 2):
            state, losses = saved[(way, local)]
            assert_same(state, expected)
            assert losses == pytest.approx(expected_losses, rel=1e-12), (way, local)
