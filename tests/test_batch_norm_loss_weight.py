"""BatchNorm over the global batch with a loss averaged over tokens (sg.set_loss_weight): the backward pass
weights each replica's contribution by the combination weight, which then comes from the declared counts,
so parameters and running statistics still equal one device trained on the same global batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_registry
from torch import nn

import stratagem as sg

VOCAB = 9
TOL = dict(rtol=1e-9, atol=1e-12)


class TokenBatchNorm(nn.Module):
    """Embedding, BatchNorm1d over the channels of every position (training mode), a per-token classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 6)
        self.norm = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(input_ids).transpose(1, 2)).transpose(1, 2)  # (batch, positions, channels)
        return self.out(torch.tanh(h))


def token_batches(sizes, lengths):
    """Sequences of 5 positions with labels -100 past each row's length in `lengths`, so replicas' slices hold very
    different numbers of tokens."""
    g = torch.Generator().manual_seed(3)
    out, rows = [], iter(lengths)
    for n in sizes:
        ids = torch.randint(0, VOCAB, (n, 5), generator=g)
        labels = torch.randint(0, VOCAB, (n, 5), generator=g)
        row_lengths = torch.tensor([next(rows) for _ in range(n)])
        labels[torch.arange(5).expand(n, 5) >= row_lengths.unsqueeze(1)] = -100
        out.append((ids, labels))
    return out


def token_loss(logits, labels, reduction="mean"):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction=reduction)


def build():
    torch.manual_seed(7)
    model = TokenBatchNorm().double()
    return model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def train_one_device(data):
    model, optimizer = build()
    for ids, labels in data:
        token_loss(model(ids), labels).backward()  # the mean over every token of the global batch
        optimizer.step()
        optimizer.zero_grad()
    return model


def train_mirrored(num_replicas, data, way="mean"):
    """way "mean": each replica's mean over its tokens, its count declared; "sum": its sum over tokens divided by
    the global count times the replicas, one weight declared everywhere (its share of the global mean)."""
    strategy = sg.MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)], registry=cpu_registry(3))
    model, optimizer = build()
    model, optimizer = strategy.distribute(model, optimizer)

    def step(ids, labels, global_tokens):
        tokens = (labels != -100).sum()
        if way == "mean":
            loss = token_loss(model(ids), labels) if tokens > 0 else token_loss(model(ids), labels, "sum")
            sg.set_loss_weight(tokens)
        else:
            loss = token_loss(model(ids), labels, "sum") / global_tokens * strategy.num_replicas_in_sync
            sg.set_loss_weight(1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    try:
        for (_, global_labels), (ids, labels) in zip(data, strategy.distribute_dataset(data)):
            strategy.run(step, args=(ids, labels, int((global_labels != -100).sum())))
    finally:
        strategy.close()
    return model


def assert_like_one_device(model, reference):
    want = reference.state_dict()
    for replica in model.replicas:
        for key, value in want.items():
            torch.testing.assert_close(replica.state_dict()[key], value, **TOL, msg=lambda m, k=key: f"{k}: {m}")


# Every slice holds tokens: 2 replicas split 7 | 6 as 4+3 | 3+3, 3 replicas as 3+2+2 | 2+2+2 (uneven).
LENGTHS = [5, 1, 4, 2, 5, 3, 1, 2, 4, 1, 5, 2, 3]


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_batch_norm_with_token_counts_declared_matches_one_device(num_replicas):
    data = token_batches([7, 6], LENGTHS)
    reference = train_one_device(data)
    model = train_mirrored(num_replicas, data)
    assert_like_one_device(model, reference)


# Over 2 replicas the second batch's second slice (rows 4-6) holds no token: that replica declares 0.
NO_TOKEN_SLICE = [5, 2, 3, 0, 1, 4, 4, 1, 2, 0, 0, 0]


def test_a_weight_of_zero_on_a_slice_with_examples_is_refused():
    # Its examples still move the others' losses through the global statistics: a weight of 0 would drop that
    # gradient (the parameters drifted from one device's by 4e-3 on this data).
    data = token_batches([6, 6], NO_TOKEN_SLICE)
    with pytest.raises(
        sg.InputError,
        match=r"BatchNorm layer 'norm' normalises with the statistics of the whole "
        r"global batch, so the examples of replica 1 move every replica's loss, "
        r"but in step 2 replica 1 declared a loss weight of 0 .* Received: "
        r"sg.set_loss_weight\(0\) on a slice of 3 example\(s\) with "
        r"batch_norm='global'\. Make each replica's loss its share",
    ):
        train_mirrored(2, data)


def test_the_refusals_remedy_an_equal_weight_and_a_share_of_the_global_loss_matches_one_device():
    data = token_batches([6, 6], NO_TOKEN_SLICE)
    assert_like_one_device(train_mirrored(2, data, way="sum"), train_one_device(data))
