"""fit takes what custom loops take: dict and nested batches, models that compute their own loss
(Hugging Face style), DataLoaders with worker processes, iterable data sets; validation batched as
training. Each checked against a plain one-device loop over the same global batches."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from cases import TOL
from conftest import cpu_registry
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import stratagem as sg

SIZES = [12, 11, 7, 2]  # uneven over 3 replicas, and one batch smaller than 3 replicas


def mirrored3() -> sg.MirroredStrategy:
    return sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3))


@dataclass
class Output:
    """What a Hugging Face model returns, in small: the loss when labels were given, and the logits."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class TinyClassifier(nn.Module):
    """Takes keyword inputs as a Hugging Face model does; computes its own loss when given labels."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.embed = nn.Embedding(10, 8, dtype=torch.float64)
        self.head = nn.Linear(8, 3, dtype=torch.float64)

    def forward(self, input_ids, attention_mask, labels=None):
        mask = attention_mask.unsqueeze(-1).to(torch.float64)
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)
        logits = self.head(pooled)
        return Output(logits, None if labels is None else F.cross_entropy(logits, labels))


def dict_batches():
    g = torch.Generator().manual_seed(2)
    return [
        {
            "input_ids": torch.randint(0, 10, (n, 5), generator=g),
            "attention_mask": (torch.rand(n, 5, generator=g) > 0.3).long(),
            "labels": torch.randint(0, 3, (n,), generator=g),
        }
        for n in SIZES
    ]


def plain_loop(model, batches, epochs=1, step=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    for _ in range(epochs):
        for batch in batches:
            loss = step(model, batch) if step else model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return model.state_dict()


def assert_state(got, expected):
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], **TOL[torch.float64])


def test_hugging_face_style_dict_batches_with_the_model_s_own_loss_match_one_device():
    batches = dict_batches()
    expected = plain_loop(TinyClassifier(), batches, epochs=2)
    model = TinyClassifier()
    history = sg.fit(
        mirrored3(),
        model,
        torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
        None,
        batches,
        epochs=2,
        metrics=["accuracy"],
        validation_data=batches,
    )
    assert_state(history.model.state_dict(), expected)
    # The metrics read outputs.logits and batch["labels"]: checked on the trained model, by hand.
    trained = TinyClassifier()
    trained.load_state_dict(expected)
    with torch.no_grad():
        correct = sum(int((trained(**b).logits.argmax(1) == b["labels"]).sum()) for b in batches)
        loss = sum(float(trained(**b).loss) * len(b["labels"]) for b in batches)
    assert history.history["val_accuracy"][-1] == pytest.approx(correct / sum(SIZES), abs=1e-12)
    assert history.history["val_loss"][-1] == pytest.approx(loss / sum(SIZES), rel=1e-9)


def test_dict_batches_with_a_loss_function_take_the_labels_from_the_batch():
    batches = dict_batches()

    def by_hand(model, batch):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return F.cross_entropy(model(**inputs).logits, batch["labels"])

    expected = plain_loop(TinyClassifier(), batches, step=by_hand)
    model = TinyClassifier()
    history = sg.fit(
        mirrored3(), model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), F.cross_entropy, batches
    )
    assert_state(history.model.state_dict(), expected)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.a, self.b = nn.Linear(4, 3, dtype=torch.float64), nn.Linear(2, 3, dtype=torch.float64)

    def forward(self, inputs):
        return self.a(inputs["dense"]) + self.b(inputs["pair"][1])


def test_nested_inputs_in_a_pair_reach_the_model_whole():
    g = torch.Generator().manual_seed(3)
    batches = [
        (
            {
                "dense": torch.randn(n, 4, generator=g, dtype=torch.float64),
                "pair": (torch.zeros(n, 1), torch.randn(n, 2, generator=g, dtype=torch.float64)),
            },
            torch.randint(0, 3, (n,), generator=g),
        )
        for n in SIZES
    ]
    expected = plain_loop(TwoInputs(), batches, step=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    model = TwoInputs()
    history = sg.fit(
        mirrored3(), model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), F.cross_entropy, batches
    )
    assert_state(history.model.state_dict(), expected)


class Stream(IterableDataset):
    """An iterable data set; under DataLoader worker processes each worker yields its own share."""

    def __init__(self, x, y) -> None:
        self.x, self.y = x, y

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, len(self.x), step):
            yield self.x[i], self.y[i]


def linear_reference(batches):
    torch.manual_seed(9)
    model = nn.Linear(6, 4, dtype=torch.float64)
    return plain_loop(model, batches, step=lambda m, b: F.cross_entropy(m(b[0]), b[1]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["map_style_workers", "iterable", "iterable_workers"])
def test_dataloaders_with_worker_processes_and_iterable_data_sets(kind):
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(32, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (32,), generator=g)
    if kind == "map_style_workers":
        loader = DataLoader(TensorDataset(x, y), batch_size=10, num_workers=2)
    else:
        loader = DataLoader(Stream(x, y), batch_size=10, num_workers=2 if kind == "iterable_workers" else 0)
    batches = list(loader)  # the batches the loader yields, in its order
    torch.manual_seed(9)
    model = nn.Linear(6, 4, dtype=torch.float64)
    history = sg.fit(
        mirrored3(), model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), F.cross_entropy, loader
    )
    assert history.epochs[0].num_examples == 32
    assert_state(history.model.state_dict(), linear_reference(batches))


def test_a_validation_data_set_is_batched_like_the_training_one_by_default():
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(20, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (20,), generator=g)
    torch.manual_seed(9)
    model = nn.Linear(6, 4, dtype=torch.float64)
    history = sg.fit(
        mirrored3(),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        F.cross_entropy,
        (x, y),
        batch_size=8,
        validation_data=(x, y),
    )
    with torch.no_grad():
        expected = float(F.cross_entropy(history.model(x), y))
    assert history.history["val_loss"] == [pytest.approx(expected, rel=1e-9)]


class SelfSupervised(TinyClassifier):
    """A model whose loss needs no labels."""

    def forward(self, input_ids, attention_mask):
        logits = super().forward(input_ids, attention_mask).logits
        return Output(logits, logits.pow(2).mean())


def test_a_model_whose_loss_needs_no_labels_trains_on_batches_without_targets():
    batches = [{k: v for k, v in b.items() if k != "labels"} for b in dict_batches()]
    expected = plain_loop(SelfSupervised(), batches)
    model = SelfSupervised()
    history = sg.fit(mirrored3(), model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), None, batches)
    assert history.epochs[0].num_examples == sum(SIZES)
    assert_state(history.model.state_dict(), expected)


class NoScores(nn.Module):
    """Returns its loss in a dict, with no scores for metrics to read."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 4, dtype=torch.float64)

    def forward(self, x, y):
        return {"loss": F.cross_entropy(self.layer(x), y)}


def test_metrics_without_scores_to_read_are_named():
    model = NoScores()
    batches = [(torch.randn(4, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 3]))]
    history = sg.fit(mirrored3(), model, torch.optim.SGD(model.parameters(), lr=0.1), None, batches)
    assert history.epochs[0].num_examples == 4  # a dict's "loss" is the model's own loss
    with pytest.raises(sg.InputError, match=r"Metrics \['accuracy'\] read the model's scores, but its output has none"):
        other = NoScores()
        sg.fit(mirrored3(), other, torch.optim.SGD(other.parameters(), lr=0.1), None, batches, metrics=["accuracy"])


def test_batches_fit_cannot_read_are_named():
    batches = dict_batches()
    model = TinyClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    no_labels = [{k: v for k, v in b.items() if k != "labels"} for b in batches]
    with pytest.raises(
        sg.InputError,
        match=r"a dict batch needs its targets under 'labels'.*\['attention_mask', "
        "'input_ids'\\]",
    ):
        sg.fit(mirrored3(), model, opt, F.cross_entropy, no_labels)
    with pytest.raises(sg.InputError, match=r"With loss=None the model must compute the loss.*Received: Output"):
        sg.fit(mirrored3(), model, opt, None, no_labels)
    with pytest.raises(sg.InputError, match=r"Metrics \['accuracy'\] compare predictions with targets"):
        own = SelfSupervised()
        sg.fit(mirrored3(), own, torch.optim.SGD(own.parameters(), lr=0.1), None, no_labels, metrics=["accuracy"])


def test_a_shuffling_loader_with_a_generator_gives_fit_its_own_first_order():
    # fit once started an iteration of the loader to see whether it was an iterator, which drew from the
    # loader's generator: the first epoch then had another order than the loader's own first one.
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 3, generator=g, dtype=torch.float64), torch.randn(20, 1, generator=g, dtype=torch.float64)

    def loader():
        return DataLoader(TensorDataset(x, y), batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(3))

    def model_and_optimizer():
        torch.manual_seed(1)
        model = nn.Linear(3, 1).to(torch.float64)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    reference, ref_opt = model_and_optimizer()
    for xb, yb in loader():
        F.mse_loss(reference(xb), yb).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model, optimizer = model_and_optimizer()
    history = sg.fit(sg.OneDeviceStrategy("cpu"), model, optimizer, F.mse_loss, loader(), epochs=1)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(history.model.state_dict()[key], value, **TOL[torch.float64])
