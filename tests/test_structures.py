"""Batches and step results of any structure: Mappings (BatchEncoding-like UserDicts), named tuples,
dataclasses, nested; non-tensor leaves reach every replica unchanged; outputs that are dataclasses or
dict-like dataclasses (Hugging Face's ModelOutput) come back from `run` and reduce leaf by leaf."""

from __future__ import annotations

import collections
import dataclasses
from collections import OrderedDict, UserDict, defaultdict, namedtuple
from collections.abc import Mapping

import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_registry
from torch import nn

import stratagem as sg
from stratagem.nest import flatten_with_paths, map_structure


class FakeBatchEncoding(UserDict):
    """What Hugging Face's BatchEncoding is: a UserDict whose constructor takes the data first, with
    attribute access to its keys."""

    def __init__(self, data=None, encoding=None):
        super().__init__(data)
        self._encodings = encoding

    def __getattr__(self, item):
        try:
            return self.data[item]
        except KeyError:
            raise AttributeError(item) from None


class ReadOnlyBatch(Mapping):
    """A user's own immutable Mapping, built from a dict."""

    def __init__(self, data):
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


class OddMapping(Mapping):
    """A Mapping that cannot be rebuilt from its items (its constructor takes something else)."""

    def __init__(self, keys, source):
        self._keys, self._source = list(keys), source

    def __getitem__(self, key):
        return self._source[key]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self):
        return len(self._keys)


@dataclasses.dataclass
class FakeModelOutput(OrderedDict):
    """Hugging Face's ModelOutput in small: an OrderedDict subclass that is also a dataclass, whose
    items are the fields that are not None."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                self[f.name] = value


@dataclasses.dataclass(frozen=True)
class Pair:
    x: torch.Tensor
    mask: torch.Tensor
    tag: str = "train"


Features = namedtuple("Features", ["x", "extra"])


def _tokens(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 10, (n, 5), generator=g),
        "attention_mask": torch.ones(n, 5, dtype=torch.long),
        "labels": torch.randint(0, 3, (n,), generator=g),
    }


class TokenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, input_ids, attention_mask, labels=None):
        h = (self.emb(input_ids) * attention_mask.unsqueeze(-1)).sum(1) / attention_mask.sum(1, keepdim=True)
        logits = self.head(h)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return FakeModelOutput(loss=loss, logits=logits)


def _train(strategy, batches):
    torch.manual_seed(3)
    net = TokenNet().double()
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    if strategy is None:
        outs = []
        for batch in batches:
            out = net(**batch)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            outs.append(out.loss.detach())
        return net, outs, []
    model, opt = strategy.distribute(net, opt)
    seen = []

    def step(batch):
        seen.append(type(batch))
        out = model(**batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        return out

    outs = []
    for batch in strategy.distribute_dataset(batches):
        out = strategy.run(step, args=(batch,))
        assert isinstance(out, FakeModelOutput) and set(out) == {"loss", "logits"}
        reduced = strategy.reduce("mean", out.__class__(loss=out.loss))
        assert isinstance(reduced, FakeModelOutput) and reduced.logits is None
        outs.append(reduced.loss)
    return model, outs, seen


@pytest.mark.parametrize(
    "make",
    [
        lambda: sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3)),
        lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"], share_parameters=False, registry=cpu_registry(2)),
        lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2)),
        lambda: sg.OneDeviceStrategy("cpu"),
    ],
    ids=["mirrored-3", "mirrored-copies", "central", "one-device"],
)
def test_batch_encoding_batches_and_model_outputs_train_like_one_device(make):
    batches = [FakeBatchEncoding(_tokens(n, seed)) for seed, n in enumerate([7, 4, 2])]
    reference, ref_losses, _ = _train(None, batches)
    strategy = make()
    model, losses, seen = _train(strategy, batches)
    assert set(seen) == {FakeBatchEncoding}  # every replica receives the user's class, not a dict
    for ref, got in zip(ref_losses, losses):
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-9, atol=1e-12)
    strategy.close() if hasattr(strategy, "close") else None


def test_nested_structures_keep_their_types_and_non_tensor_leaves_reach_every_replica_unchanged():
    config = {"name": "run-1", "steps": [1, 2]}
    marker = object()
    batch = {
        "pair": Pair(torch.arange(5.0), torch.ones(5, 2)),
        "features": Features(torch.zeros(5, 3), [torch.arange(5), "text"]),
        "ro": ReadOnlyBatch({"t": torch.ones(5)}),
        "dd": defaultdict(list, {"t": torch.ones(5)}),
        "od": OrderedDict(t=torch.ones(5)),
        "config": config,
        "marker": marker,
        "none": None,
    }
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    (distributed,) = list(strategy.distribute_dataset([batch]))
    got = []

    def step(b):
        got.append(b)
        return b["pair"].x.sum()

    strategy.run(step, args=(distributed,))
    assert len(got) == 2
    sizes = []
    for b in got:
        assert type(b["pair"]) is Pair and b["pair"].tag == "train"
        assert type(b["features"]) is Features and type(b["features"].extra) is list
        assert b["features"].extra[1] == "text"
        assert type(b["ro"]) is ReadOnlyBatch
        assert type(b["dd"]) is defaultdict and b["dd"].default_factory is list
        assert type(b["od"]) is OrderedDict
        assert b["config"] is config and b["marker"] is marker and b["none"] is None
        sizes.append(b["pair"].x.shape[0])
        assert b["features"].extra[0].shape[0] == b["pair"].x.shape[0] == b["ro"]["t"].shape[0]
    assert sizes == [3, 2]
    torch.testing.assert_close(torch.cat([b["pair"].x for b in got]), torch.arange(5.0))
    strategy.close()


def test_mapping_that_cannot_be_rebuilt_becomes_a_dict():
    odd = OddMapping(["a"], {"a": torch.ones(2)})
    out = map_structure(lambda t: t * 2, odd)
    assert type(out) is dict and torch.equal(out["a"], torch.full((2,), 2.0))


def test_paths_name_keys_indices_and_fields():
    batch = {"a": [torch.zeros(1), Pair(torch.zeros(1), torch.zeros(1))], 3: Features(torch.zeros(1), None)}
    assert [p for p, _ in flatten_with_paths(batch, "batch")] == [
        'batch["a"][0]',
        'batch["a"][1].x',
        'batch["a"][1].mask',
        'batch["a"][1].tag',
        "batch[3].x",
        "batch[3].extra",
    ]


def test_batch_whose_tensors_disagree_names_the_two_keys():
    batch = FakeBatchEncoding({"input_ids": torch.zeros(4, 5), "labels": torch.zeros(3)})
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    with pytest.raises(sg.InputError, match=r'batch\["labels"\] holds 3 examples and batch\["input_ids"\] holds 4'):
        next(iter(strategy.distribute_dataset([batch])))
    strategy.close()


def test_batch_with_no_tensor_anywhere_is_refused():
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"], registry=cpu_registry(2))
    with pytest.raises(sg.InputError, match=r"no tensor in it"):
        next(iter(strategy.distribute_dataset([FakeBatchEncoding({"text": ["a", "b"]})])))
    strategy.close()


@dataclasses.dataclass
class StepResult:
    loss: torch.Tensor
    correct: torch.Tensor
    note: str | None = None


def test_dataclass_results_reduce_field_by_field_weighted_by_examples():
    x = torch.arange(10.0).unsqueeze(1)
    strategy = sg.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], registry=cpu_registry(3))
    (distributed,) = list(strategy.distribute_dataset([(x,)]))

    def step(batch):
        (xs,) = batch
        return StepResult(loss=xs.mean(), correct=(xs > 4).sum().double(), note=None)

    out = strategy.run(step, args=(distributed,))
    assert isinstance(out, StepResult)
    mean = strategy.reduce("mean", out)
    assert isinstance(mean, StepResult) and mean.note is None
    torch.testing.assert_close(mean.loss, x.mean())  # 4/3/3 slices: the mean over the global batch
    total = strategy.reduce("sum", out)
    torch.testing.assert_close(total.correct, torch.tensor(5.0, dtype=torch.float64))
    strategy.close()


def test_same_results_come_back_from_every_structure_kind():
    ref = {"a": collections.OrderedDict(b=(torch.ones(1),))}
    out = map_structure(lambda t: t + 1, ref)
    assert type(out["a"]) is collections.OrderedDict and type(out["a"]["b"]) is tuple
    assert map_structure(lambda t: t, ref) is ref  # nothing changed: the very object comes back
