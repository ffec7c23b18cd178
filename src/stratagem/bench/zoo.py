"""The real models of the model-zoo tests and of `benchmarks/real_models.py`, built from configurations so
nothing is downloaded, with the one-device training step their users write.

- `ResNet18`: torchvision's `resnet18` layout (7x7 stem, max-pool, four stages of two basic blocks,
  BatchNorm after every convolution, residual adds, 1x1 projections where a stage changes width or
  stride, global average pool) at any first-stage width. torchvision itself is not used: the only
  torchvision wheel for torch 2.13 on this project's machines is a CUDA build whose C++ operators do not
  load beside the CPU torch (`import torchvision` fails with "operator torchvision::nms does not exist").
- `gpt2` and `bert`: a Hugging Face `GPT2LMHeadModel` (tied input and output embeddings, the model
  computing `outputs.loss` from `labels`) and `BertForSequenceClassification`, dropout 0 so runs compare.

Example:
    >>> model = ResNet18(width=4, num_classes=3)
    >>> model(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def quiet_transformers() -> None:
    """Silences transformers' warnings about a tiny configuration (GPT-2's default special-token ids)."""
    logging.getLogger("transformers").setLevel(logging.ERROR)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm, added to the (projected) input."""

    def __init__(self, cin: int, cout: int, stride: int, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = norm(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)


class ResNet18(nn.Module):
    """torchvision's resnet18 layout at `width` channels in the first stage (torchvision's is 64);
    `batch_norm=False` puts identities where the BatchNorm layers are."""

    def __init__(self, width: int = 8, num_classes: int = 10, batch_norm: bool = True) -> None:
        super().__init__()
        norm: Callable[[int], nn.Module] = nn.BatchNorm2d if batch_norm else (lambda c: nn.Identity())
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = norm(width)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = [width, 2 * width, 4 * width, 8 * width]
        stages, cin = [], width
        for stage, cout in enumerate(widths):
            stride = 1 if stage == 0 else 2
            stages.append(nn.Sequential(BasicBlock(cin, cout, stride, norm), BasicBlock(cout, cout, 1, norm)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def gpt2(*, vocab: int, positions: int, width: int, layers: int, heads: int) -> nn.Module:
    """A GPT-2 language model of the given sizes (no dropout)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    quiet_transformers()
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=positions,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def bert(
    *, vocab: int, positions: int, width: int, layers: int, heads: int, intermediate: int, num_labels: int
) -> nn.Module:
    """A BERT sequence classifier of the given sizes (no dropout, padding id 0)."""
    from transformers import BertConfig, BertForSequenceClassification

    quiet_transformers()
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=positions,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    config.num_labels = num_labels  # a property of PretrainedConfig (it sizes id2label), not a declared argument
    return BertForSequenceClassification(config)


def adamw_groups(model: nn.Module) -> list[dict[str, Any]]:
    """AdamW's two parameter groups as the Hugging Face examples make them: no weight decay on biases and
    LayerNorm weights."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        (no_decay if name.endswith("bias") or "LayerNorm" in name else decay).append(p)
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


def loss_of(name: str, model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss as each model's users compute it: the Hugging Face models return it, the ResNet takes
    cross-entropy of its logits."""
    if name == "resnet18":
        x, y = batch
        return F.cross_entropy(model(x), y)
    return model(**batch).loss


def make_step(
    name: str, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> Callable[[Any], torch.Tensor]:
    """The one-device training step, written once and run unchanged by every strategy: loss, backward, the
    gradient norm clipped to 1, the optimizer's step, the scheduler's step (when there is one)."""

    def step(batch: Any) -> torch.Tensor:
        loss = loss_of(name, model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        return loss.detach()

    return step
