"""The model zoo of the real-model tests: models as users build them, their batches, their training
loops, and the plain one-device loop each strategy is compared with.

Every model is built from a configuration, so nothing is downloaded (the builders and the step function are
`stratagem.bench.zoo`'s, shared with benchmarks/real_models.py, which runs the same models at real sizes):

- a tiny Hugging Face GPT-2 (tied input and output embeddings, dict batches with `labels`, the model
  computing `outputs.loss`), AdamW with transformers' `get_linear_schedule_with_warmup`;
- a tiny Hugging Face BERT sequence classifier (dropout 0, so runs compare), fed `BatchEncoding`
  batches with padding, AdamW with two parameter groups (no weight decay on biases and LayerNorm,
  as the Hugging Face examples do) and the same schedule;
- a ResNet-18 of this module's own: torchvision's `resnet18` layout (7x7 stem, max-pool, four stages
  of two basic blocks, BatchNorm after every convolution, residual adds, 1x1 projections where a stage
  changes width or stride, global average pool, 10 classes) at a width of 8 channels instead of 64, for
  32x32 inputs, SGD with Nesterov momentum and weight decay. torchvision itself is not used: the only
  torchvision wheel for torch 2.13 on this project's machines is a CUDA build whose C++ operators do not
  load beside the CPU torch (`import torchvision` fails with "operator torchvision::nms does not exist").

Each loop clips the gradient norm between backward and the optimizer step, and steps the scheduler
inside the step function, as a one-device script does.

`simple=True` builds the same models with what this test set relies on least: SGD and no scheduler,
the ResNet without BatchNorm (identity instead), BERT's batches as plain dicts. It checks the harness.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stratagem.bench.zoo import ResNet18, adamw_groups, bert, gpt2, loss_of, make_step

__all__ = ["ResNet18", "loss_of", "make_step"]  # re-exported: the tests reach them as zoo.<name>

NUM_CLASSES = 10
BATCH_SIZES = [7, 5, 4]  # 2 replicas: 4+3, 3+2, 2+2; 3 replicas: 3+2+2, 2+2+1, 2+1+1
SEQ_LEN = 8
VOCAB = 48
MODEL_NAMES = ("bert", "gpt2", "resnet18")

# GPT-2's loss is computed by transformers in float32 whatever the model's dtype (ForCausalLMLoss calls
# logits.float()), so its gradients carry float32 rounding: it is compared at the float32 tolerance.
TOL = {
    "gpt2": dict(rtol=1e-5, atol=1e-6),
    "bert": dict(rtol=1e-9, atol=1e-12),
    "resnet18": dict(rtol=1e-9, atol=1e-12),
}


# ---- models (built by stratagem.bench.zoo, shared with benchmarks/real_models.py) -------------------
def tiny_gpt2() -> nn.Module:
    return gpt2(vocab=VOCAB, positions=16, width=32, layers=2, heads=2)


def tiny_bert() -> nn.Module:
    return bert(vocab=VOCAB, positions=16, width=32, layers=2, heads=2, intermediate=64, num_labels=3)


# ---- batches ----------------------------------------------------------------------------------------
def make_batches(name: str, sizes: list[int] = BATCH_SIZES, seed: int = 1, simple: bool = False) -> list[Any]:
    """Global batches for model `name`, the same on every call with the same seed (`simple`: plain dicts
    where the real configuration has `BatchEncoding`)."""
    g = torch.Generator().manual_seed(seed)
    batches: list[Any] = []
    for n in sizes:
        if name == "resnet18":
            x = torch.randn(n, 3, 32, 32, generator=g, dtype=torch.float64)
            batches.append((x, torch.randint(0, NUM_CLASSES, (n,), generator=g)))
        elif name == "gpt2":
            # No padding: every sequence has SEQ_LEN - 1 predicted tokens, so weighting replicas by their
            # examples weights them by their tokens too, and the token mean over the global batch is kept.
            ids = torch.randint(1, VOCAB, (n, SEQ_LEN), generator=g)
            batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
        elif name == "bert":
            from transformers import BatchEncoding

            wrap = dict if simple else BatchEncoding
            ids = torch.randint(1, VOCAB, (n, SEQ_LEN), generator=g)
            lengths = torch.randint(3, SEQ_LEN + 1, (n,), generator=g)
            mask = (
                torch.arange(SEQ_LEN)[None, :] < lengths[:, None]
            ).long()  # padded to the longest, as a collator does
            ids = ids * mask
            batches.append(
                wrap(
                    {
                        "input_ids": ids,
                        "token_type_ids": torch.zeros_like(ids),
                        "attention_mask": mask,
                        "labels": torch.randint(0, 3, (n,), generator=g),
                    }
                )
            )
        else:
            raise KeyError(name)
    return batches


# ---- models, optimizers, schedulers -----------------------------------------------------------------
@dataclass
class Setup:
    """A model with its optimizer factory and scheduler factory (None: no scheduler)."""

    model: nn.Module
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    make_scheduler: Callable[[torch.optim.Optimizer], Any] | None


def _warmup(optimizer: torch.optim.Optimizer) -> Any:
    from transformers import get_linear_schedule_with_warmup

    return get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=len(BATCH_SIZES) + 1)


def build(name: str, simple: bool = False) -> Setup:
    """Model `name` with fixed initial parameters (float64) and its training configuration."""
    torch.manual_seed(42)
    if name == "resnet18":
        model = ResNet18(batch_norm=not simple).to(torch.float64)
    elif name == "gpt2":
        model = tiny_gpt2().to(torch.float64)
    elif name == "bert":
        model = tiny_bert().to(torch.float64)
    else:
        raise KeyError(name)
    if simple:
        return Setup(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.05), None)
    if name == "resnet18":
        return Setup(
            model,
            lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4),
            None,
        )
    if name == "gpt2":
        return Setup(model, lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01), _warmup)
    return Setup(model, lambda m: torch.optim.AdamW(adamw_groups(m), lr=3e-3), _warmup)


def train_reference(name: str, simple: bool = False, batches: list[Any] | None = None) -> tuple[nn.Module, list[float]]:
    """The plain PyTorch loop on one device: the expected parameters and the losses."""
    setup = build(name, simple)
    model = setup.model
    optimizer = setup.make_optimizer(model)
    scheduler = setup.make_scheduler(optimizer) if setup.make_scheduler else None
    step = make_step(name, model, optimizer, scheduler)
    model.train()
    losses = [float(step(batch)) for batch in (batches if batches is not None else make_batches(name, simple=simple))]
    return model, losses


def train_with(strategy: Any, name: str, simple: bool = False) -> tuple[nn.Module, list[float]]:
    """The same loop under `strategy`: distribute, then the scheduler on the distributed optimizer, handed to the
    strategy (the port's one extra line, docs/porting.md), since the step function steps it on every replica."""
    setup = build(name, simple)
    model, optimizer = strategy.distribute(setup.model, setup.make_optimizer(setup.model))
    scheduler = setup.make_scheduler(optimizer) if setup.make_scheduler else None
    if scheduler is not None:
        scheduler = strategy.distribute_scheduler(scheduler)
    step = make_step(name, model, optimizer, scheduler)
    model.train()
    losses = []
    for batch in strategy.distribute_dataset(make_batches(name, simple=simple)):
        losses.append(float(strategy.reduce("mean", strategy.run(step, args=(batch,)))))
    return model, losses


def worst_relative_error(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest |got - expected| / max|expected| over the floating-point entries, and its key; a tensor
    whose largest value is under 1e-3 counts relative to 1e-3 (BERT's attention key biases get no gradient,
    softmax ignoring them, and stay within float rounding of zero)."""
    worst, where = 0.0, ""
    for key, want in expected.items():
        if not want.is_floating_point():
            continue
        have = got[key].to(want.device)
        error = float((have - want).abs().max() / want.abs().max().clamp_min(1e-3))
        if error > worst:
            worst, where = error, key
    return worst, where


def assert_same_state(name: str, expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    """Every parameter and buffer (BatchNorm's running statistics included) equals one device's."""
    assert expected.keys() == got.keys()
    for key, want in expected.items():
        torch.testing.assert_close(got[key].to(want.device), want, **TOL[name], msg=lambda m, k=key: f"{name} {k}: {m}")


def table(strategies: dict[str, Callable[[], Any]], simple: bool = False) -> list[tuple[str, str, str]]:
    """(model, strategy, worst relative error against one device, or the error raised) for every pair."""
    rows = []
    for name in MODEL_NAMES:
        expected, _ = train_reference(name, simple)
        for label, make in strategies.items():
            strategy = make()
            try:
                model, _ = train_with(strategy, name, simple)
                worst = max(
                    worst_relative_error(expected.state_dict(), r.state_dict())
                    for r in getattr(model, "replicas", [model])
                )
                rows.append((name, label, f"{worst[0]:.1e} ({worst[1]})"))
            except Exception as error:  # noqa: BLE001 - the table reports what failed, and how
                rows.append((name, label, f"{type(error).__name__}: {str(error).splitlines()[0][:90]}"))
            finally:
                getattr(strategy, "close", lambda: None)()
    return rows


if __name__ == "__main__":
    # python tests/zoo.py [simple]: the in-process part of the table of tests/test_models.py.
    import sys

    from test_models import STRATEGIES

    for row in table(STRATEGIES, simple=sys.argv[1:] == ["simple"]):
        print(" | ".join(row))
