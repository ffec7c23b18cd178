"""The step's activation bytes measured on fake tensors (issue 39, item 1), worked out by hand on a small model;
no process group needed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stratagem.errors import InputError
from stratagem.strategies.activation_memory import measure_activations
from stratagem.strategies.sharded.memory import plan_memory


def three_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 3, bias=False))


def test_the_activations_of_a_small_model_by_hand():
    # 5 examples, float32. Forward: h = x W1^T (5x8, 160 B) is freed once ReLU made r (5x8, 160 B), which both
    # ReLU's and the second layer's backward keep; the output (5x3, 60 B) and its sum (4 B): 224 B at the end.
    # Backward: the sum's gradient (4 B), then the second layer's input gradient (160 B) and weight gradient
    # (3x8, 96 B, dropped once accumulated), then ReLU's input gradient (160 B): 224 + 4 + 160 + 160 = 548 B.
    estimate = measure_activations(three_layers(), torch.randn(5, 4))
    assert estimate.after_forward == 224
    assert estimate.peak == 548
    assert estimate.how.startswith("measured: one forward and backward")


def test_the_measurement_leaves_the_generator_the_buffers_and_the_gradients_as_they_were():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(6, 4)
    state = torch.random.get_rng_state()
    measure_activations(model, (x,))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_keyword_inputs_and_a_loss_in_the_output_are_what_a_hugging_face_model_takes():
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4, bias=False)

        def forward(self, features: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
            out = self.layer(features)
            return {"logits": out, "loss": ((out - target) ** 2).mean()}

    x = torch.randn(10, 4)
    estimate = measure_activations(WithLoss(), {"features": x, "target": x})
    # Forward: out (160 B, returned), out - target (160 B, kept by the square's backward), its square (160 B,
    # freed: the mean's backward needs only its shape), the loss (4 B).
    assert estimate.after_forward == 160 + 160 + 4


def test_a_forward_that_reads_a_value_is_refused_with_the_fix():
    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.layer(x)
            return out * 2 if out.sum().item() > 0 else out

    with pytest.raises(InputError, match=r"could not be measured on fake tensors.*memory_plan\(activations=\.\.\.\)"):
        measure_activations(Reads(), torch.randn(3, 4))


def test_inputs_of_another_kind_and_an_output_without_a_gradient_are_refused():
    with pytest.raises(InputError, match=r"example_inputs must be the model's inputs.*Received: int"):
        measure_activations(three_layers(), 5)
    frozen = three_layers().requires_grad_(False)
    with pytest.raises(
        InputError, match=r"no tensor to take a backward from. Received: a tensor that needs no gradient"
    ):
        measure_activations(frozen, torch.randn(2, 4))


def test_the_plan_takes_the_activations_beside_what_is_gathered_as_backward_starts():
    model = nn.Linear(10, 5)  # 220 B; rank 1 holds 2 of 5 rows: parameters 88 B, AdamW state 2 * 88 + 2 * 4
    params = list(model.parameters())
    kw = dict(rank=1, world_size=2, largest_unit_bytes=220, num_units=1, root_bytes=20)
    none = plan_memory(params, torch.optim.AdamW(params), stage=3, **kw)
    assert none.activations == 0 and "activations not counted" in str(none)
    stage3 = plan_memory(params, torch.optim.AdamW(params), stage=3, activations=5000, activations_how="given", **kw)
    # Stage 3: the state at rest, the root (kept gathered from forward to backward) and the activations, which
    # here outweigh the gradient shards beside the working set (88 + 880).
    assert stage3.training_peak == 88 + 184 + 20 + 5000 == stage3.total
    assert "activations 4.9 KiB (given)" in str(stage3)
    # Stage 2: every unit is gathered when backward starts: the whole model beside the activations.
    stage2 = plan_memory(params, torch.optim.AdamW(params), stage=2, activations=5000, **kw)
    assert stage2.training_peak == 88 + 184 + 220 + 5000
    # Activations smaller than the working set leave the step's peak where it was.
    small = plan_memory(params, torch.optim.AdamW(params), stage=3, activations=10, **kw)
    assert small.training_peak == none.training_peak
