"""EarlyStopping, ModelCheckpoint, CSVLogger, TensorBoard and seed_everything, under Mirrored x2
(the multi-worker case, chief-only writes included, is tests/test_usability_multi_worker.py)."""

from __future__ import annotations

import csv
import random
import sys

import numpy
import pytest
import torch
import torch.nn.functional as F
from cases import TOL, build, make_batches, train_reference
from conftest import cpu_registry
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from stratagem.train.model_checkpoint import write_atomically

SIZES = [12, 11, 7, 5]


def mirrored2() -> sg.MirroredStrategy:
    return sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(3))


def reference_after(epochs: int, batches) -> dict[str, torch.Tensor]:
    """A plain one-device loop over the same global batches, `epochs` times."""
    model, optimizer, _ = build("mlp", "sgd_momentum", torch.float64)
    train_reference(model, optimizer, batches, clip=False, epochs=epochs)
    return model.state_dict()


def fit_with(callbacks, epochs=3, **kwargs):
    model, optimizer, shape = build("mlp", "sgd_momentum", torch.float64)
    batches = make_batches(shape, torch.float64, sizes=SIZES)
    history = sg.fit(
        mirrored2(), model, optimizer, F.cross_entropy, batches, epochs=epochs, callbacks=callbacks, **kwargs
    )
    return history, batches


def assert_state(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key].to(torch.float64), expected[key], **TOL[torch.float64])


def test_early_stopping_stops_after_patience_and_restores_the_best_weights():
    # A min_delta no change can beat: epoch 1 improves on "nothing yet", no later epoch improves.
    stop = sg.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=1e9, restore_best_weights=True)
    history, batches = fit_with([stop], epochs=6)
    assert len(history.epochs) == 3 and stop.stopped_epoch == 3 and stop.best_epoch == 1
    assert_state(history.model.state_dict(), reference_after(1, batches))
    for replica in history.model.replicas:  # every replica holds the restored weights
        assert_state(replica.state_dict(), reference_after(1, batches))


def test_early_stopping_on_a_metric_that_improves_runs_every_epoch_and_keeps_the_last_weights():
    stop = sg.callbacks.EarlyStopping(monitor="loss", mode="min", patience=0, restore_best_weights=True)
    history, batches = fit_with([stop], epochs=3)
    losses = history.history["loss"]
    assert losses[0] > losses[1] > losses[2] and stop.stopped_epoch == 0 and stop.best_epoch == 3
    assert_state(history.model.state_dict(), reference_after(3, batches))


def test_early_stopping_names_a_metric_the_run_does_not_measure_and_bad_settings():
    with pytest.raises(sg.InputError, match=r"monitors 'val_loss', which this run does not measure.*\['loss'\]"):
        fit_with([sg.callbacks.EarlyStopping()], epochs=1)
    with pytest.raises(sg.InputError, match="patience must be a whole number.*Received: patience=-1"):
        sg.callbacks.EarlyStopping(patience=-1)
    with pytest.raises(sg.InputError, match="mode must be 'auto', 'min' or 'max'. Received: mode='up'"):
        sg.callbacks.EarlyStopping(mode="up")
    with pytest.raises(sg.InputError, match="min_delta must be a number, 0 or more"):
        sg.callbacks.EarlyStopping(min_delta=-1)


def test_model_checkpoint_every_n_epochs_and_best_only_in_both_formats(tmp_path):
    from safetensors.torch import load_file

    every = sg.callbacks.ModelCheckpoint(tmp_path / "every" / "epoch{epoch}-{loss:.2f}.pt", every_n_epochs=2)
    best = sg.callbacks.ModelCheckpoint(
        tmp_path / "best.safetensors", monitor="loss", save_best_only=True, min_delta=1e9, format="safetensors"
    )
    history, batches = fit_with([every, best], epochs=3)
    losses = history.history["loss"]
    assert [p.name for p in every.saved] == [f"epoch2-{losses[1]:.2f}.pt", f"epoch3-{losses[2]:.2f}.pt"]
    assert_state(torch.load(every.saved[0], weights_only=True), reference_after(2, batches))
    assert_state(torch.load(every.saved[1], weights_only=True), reference_after(3, batches))
    assert best.saved == [tmp_path / "best.safetensors"]  # only epoch 1 improved by more than 1e9
    assert_state(load_file(tmp_path / "best.safetensors"), reference_after(1, batches))
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_write_that_fails_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = tmp_path / "model.pt"
    write_atomically(path, lambda handle: handle.write(b"old"))

    def torn(handle):
        handle.write(b"half a ne")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, torn)
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_model_checkpoint_refuses_bad_settings(tmp_path, monkeypatch):
    with pytest.raises(sg.InputError, match="Unknown checkpoint format. Received: format='onnx'"):
        sg.callbacks.ModelCheckpoint(tmp_path / "m", format="onnx")
    with pytest.raises(sg.InputError, match="every_n_epochs must be a positive integer"):
        sg.callbacks.ModelCheckpoint(tmp_path / "m", every_n_epochs=0)
    with pytest.raises(sg.InputError, match=r"names a value the epoch log does not have.*\{val_acc\}"):
        fit_with([sg.callbacks.ModelCheckpoint(str(tmp_path / "m{val_acc}.pt"))], epochs=1)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(sg.InputError, match=r"needs the safetensors package.*pip install safetensors"):
        sg.callbacks.ModelCheckpoint(tmp_path / "m", format="safetensors")


def test_csv_logger_writes_one_row_per_epoch_and_appends_when_asked(tmp_path):
    path = tmp_path / "logs" / "run.csv"
    history, _ = fit_with([sg.callbacks.CSVLogger(path)], epochs=2)
    rows = list(csv.DictReader(path.open()))
    assert [int(r["epoch"]) for r in rows] == [1, 2]
    assert [float(r["loss"]) for r in rows] == pytest.approx(history.history["loss"], rel=1e-12)
    assert list(rows[0]) == ["epoch", "loss", "num_examples", "elapsed_s"]
    fit_with([sg.callbacks.CSVLogger(path, append=True)], epochs=1)
    assert len(list(csv.DictReader(path.open()))) == 3
    fit_with([sg.callbacks.CSVLogger(path)], epochs=1)  # a new run starts the file afresh
    assert len(list(csv.DictReader(path.open()))) == 1


def test_tensorboard_writes_the_epoch_metrics_and_running_ones(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    history, _ = fit_with([sg.callbacks.TensorBoard(tmp_path / "tb", update_freq=2)], epochs=2)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    epoch_loss = events.Scalars("epoch_loss")
    assert [e.step for e in epoch_loss] == [1, 2]
    assert [e.value for e in epoch_loss] == pytest.approx(history.history["loss"], rel=1e-6)
    assert [e.step for e in events.Scalars("batch_loss")] == [2, 4, 6, 8]


def test_tensorboard_without_the_package_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(sg.InputError, match=r"needs the tensorboard package.*pip install tensorboard"):
        sg.callbacks.TensorBoard(tmp_path)


def draws():
    return random.random(), float(numpy.random.rand()), float(torch.rand(1))


def test_seed_everything_makes_every_generator_and_a_multi_process_loader_repeat():
    data = TensorDataset(torch.arange(16))

    def epoch_order():
        loader = DataLoader(data, batch_size=4, shuffle=True, num_workers=2)
        return [batch[0].tolist() for batch in loader]

    assert sg.seed_everything(7) == 7
    first = draws(), epoch_order()
    sg.seed_everything(7)
    assert (draws(), epoch_order()) == first
    sg.seed_everything(8)
    assert draws() != first[0]


def test_seed_everything_gives_the_same_fit_twice_under_mirrored():
    def run():
        sg.seed_everything(3)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).double()
        x, y = torch.randn(40, 6, dtype=torch.float64), torch.randint(0, 4, (40,))
        loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
        history = sg.fit(
            mirrored2(), model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, loader, epochs=2
        )
        return history.model.state_dict()

    first, second = run(), run()
    for key in first:
        assert torch.equal(first[key], second[key])


def test_seed_everything_refuses_a_seed_numpy_cannot_take():
    with pytest.raises(sg.InputError, match=r"seed must be a whole number in \[0, 4294967295\]. Received: seed=-1"):
        sg.seed_everything(-1)


@pytest.mark.timeout(60)
def test_backups_under_the_parameter_server_are_refused_before_training(tmp_path):
    from stratagem.strategies.parameter_server import InProcessCluster

    class Began(sg.callbacks.Callback):
        began = False

        def on_train_begin(self, context):
            Began.began = True

    model, optimizer, shape = build("mlp", "sgd_momentum", torch.float64)
    with InProcessCluster(num_workers=1, num_ps=1) as cluster:
        strategy = sg.ParameterServerStrategy(cluster)
        try:
            with pytest.raises(
                sg.InputError,
                match=r"BackupAndRestore cannot back up this optimizer: "
                r"ParameterServerOptimizer has no state_dict.*strategy.save",
            ):
                sg.fit(
                    strategy,
                    model,
                    optimizer,
                    F.cross_entropy,
                    make_batches(shape, torch.float64),
                    callbacks=[sg.callbacks.BackupAndRestore(tmp_path / "b"), Began()],
                )
        finally:
            strategy.close()
    assert not Began.began and not (tmp_path / "b").exists()
