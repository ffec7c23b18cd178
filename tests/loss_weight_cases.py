"""A token-level loss over padded labels (Hugging Face's -100 convention), trained on one device
(strategy None) and under a strategy, two ways: the mean over each replica's tokens with its count
declared by sg.set_loss_weight, or the sum over its tokens divided by the global count (an equal
weight declared, and the replicas' shares added up). Shared by tests/test_loss_weights.py and
tests/workers/mwms_loss_weights.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg

VOCAB = 11
SIZES = [7, 6, 5]


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.out = nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(input_ids)))


def batches() -> list[dict[str, torch.Tensor]]:
    """Sequences of 6 tokens whose labels are -100 after a length that varies a lot between rows, so
    replicas' slices hold very different numbers of tokens."""
    g = torch.Generator().manual_seed(5)
    out = []
    for n in SIZES:
        ids = torch.randint(0, VOCAB, (n, 6), generator=g)
        labels = torch.randint(0, VOCAB, (n, 6), generator=g)
        lengths = torch.randint(0, 7, (n,), generator=g)
        labels[torch.arange(6).expand(n, 6) >= lengths.unsqueeze(1)] = -100
        labels[0, 0] = int(ids[0, 0])  # at least one token per global batch
        out.append({"input_ids": ids, "labels": labels})
    return out


def token_loss(model: nn.Module, batch: dict[str, torch.Tensor], reduction: str = "mean") -> torch.Tensor:
    logits = model(batch["input_ids"])
    return F.cross_entropy(
        logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=-100, reduction=reduction
    )


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(11)
    model = TinyLM().double()
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def train(strategy, way: str = "mean") -> tuple[dict[str, torch.Tensor], list[float]]:
    """way: "mean" (declared counts), "sum" (sum over tokens / global count), "undeclared" (examples)."""
    model, opt = build()
    if strategy is None:
        losses = []
        for batch in batches():
            loss = token_loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        return model.state_dict(), losses
    model, opt = strategy.distribute(model, opt)

    def step(batch, global_tokens):
        n_tokens = (batch["labels"] != -100).sum()
        if way == "mean":
            loss = token_loss(model, batch) if n_tokens > 0 else token_loss(model, batch, "sum")
            sg.set_loss_weight(n_tokens)
        elif way == "sum":
            # This replica's share of the global mean; shares add up, so every replica weighs the same.
            loss = token_loss(model, batch, "sum") / global_tokens * strategy.num_replicas_in_sync
            sg.set_loss_weight(1)
        else:
            loss = token_loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    losses = []
    for global_batch, batch in zip(batches(), strategy.distribute_dataset(batches())):
        global_tokens = int((global_batch["labels"] != -100).sum())
        losses.append(float(strategy.reduce("mean", strategy.run(step, args=(batch, global_tokens)))))
    return model.state_dict(), losses
