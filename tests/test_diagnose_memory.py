"""The training-memory estimate and the free-memory check; byte counts worked out by hand."""

from __future__ import annotations

import pytest
import torch

from stratagem.diagnose import (
    EnvironmentFacts,
    GpuFacts,
    check_memory,
    ensure_fits,
    estimate_training_memory,
    format_bytes,
)
from stratagem.errors import MemoryEstimateError, MemoryEstimateInputError

GiB, MiB = 2**30, 2**20
LINEAR_BYTES = (10 * 5 + 5) * 4  # Linear(10, 5) in float32: 55 parameters of 4 bytes = 220


def linear() -> torch.nn.Linear:
    return torch.nn.Linear(10, 5)


def test_estimate_from_bytes_and_name():
    estimate = estimate_training_memory(1000, "adam")
    assert (estimate.parameter_bytes, estimate.gradient_bytes, estimate.optimizer_state_bytes) == (1000, 1000, 2000)
    assert estimate.total_bytes == 4000
    assert estimate.to_dict()["total_bytes"] == 4000


@pytest.mark.parametrize(
    "make_optimizer, total",
    [
        (lambda p: torch.optim.SGD(p, lr=0.1), 2 * LINEAR_BYTES),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 3 * LINEAR_BYTES),
        (lambda p: torch.optim.Adam(p), 4 * LINEAR_BYTES),
        (lambda p: torch.optim.AdamW(p), 4 * LINEAR_BYTES),
        (lambda p: torch.optim.Adam(p, amsgrad=True), 5 * LINEAR_BYTES),
        (lambda p: torch.optim.RMSprop(p), 3 * LINEAR_BYTES),
        (lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True), 5 * LINEAR_BYTES),
        (lambda p: torch.optim.Adagrad(p), 3 * LINEAR_BYTES),
    ],
)
def test_estimate_from_model_and_optimizer(make_optimizer, total):
    model = linear()
    assert estimate_training_memory(model, make_optimizer(model.parameters())).total_bytes == total


def test_frozen_parameters_have_no_gradient_or_state():
    model = linear()
    model.bias.requires_grad_(False)  # 5 frozen parameters: 20 bytes
    estimate = estimate_training_memory(model, torch.optim.SGD([model.weight], lr=0.1, momentum=0.9))
    assert (estimate.parameter_bytes, estimate.gradient_bytes, estimate.optimizer_state_bytes) == (220, 200, 200)


def test_no_optimizer():
    assert estimate_training_memory(1000, None).total_bytes == 2000


def test_unknown_optimizer():
    model = linear()
    with pytest.raises(MemoryEstimateInputError, match=r"state size of LBFGS\. Received: optimizer=LBFGS\. Use SGD"):
        estimate_training_memory(model, torch.optim.LBFGS(model.parameters()))
    with pytest.raises(MemoryEstimateInputError, match=r"Received: optimizer='lion'\. Use one of \['adagrad', 'adam'"):
        estimate_training_memory(1000, "lion")


def test_bad_model_argument():
    with pytest.raises(MemoryEstimateInputError, match=r"Received: model_or_param_bytes=-1\. Pass the model"):
        estimate_training_memory(-1, "sgd")


@pytest.mark.parametrize(
    "count, text",
    [(1023, "1023 B"), (1536, "1.50 KiB"), (5 * MiB, "5.00 MiB"), (3 * GiB, "3.00 GiB"), (1024 * GiB, "1024.00 GiB")],
)
def test_format_bytes(count, text):
    assert format_bytes(count) == text


def facts_with_free(*free: int) -> EnvironmentFacts:
    return EnvironmentFacts(
        torch_version="2.4.0+cu124",
        torch_cuda_version="12.4",
        torch_device_count=len(free),
        gpus=[GpuFacts(index=i, name="Test GPU", total_memory=16 * GiB, free_memory=f) for i, f in enumerate(free)],
    )


def test_not_enough_free_memory_gives_both_numbers_and_the_options():
    check = check_memory(facts_with_free(1 * GiB, 10 * GiB), estimate_training_memory(GiB, "adam"))
    assert check.verdict == "problem"
    assert check.reason == (
        "Training needs at least 4.00 GiB (parameters 1.00 GiB + gradients 1.00 GiB + adam "
        "(2x parameters) state 2.00 GiB; activations not counted) per replica, but cuda:0 "
        "has 1.00 GiB free of 16.00 GiB."
    )
    assert check.fix.startswith(
        "Either use fewer replicas, on the GPUs with room (devices=['cuda:1']); or CentralStorageStrategy"
    )
    assert "model parallelism" in check.fix


def test_no_gpu_with_room():
    check = check_memory(facts_with_free(GiB, GiB), estimate_training_memory(GiB, "adam"))
    assert "cuda:0 has 1.00 GiB free of 16.00 GiB, cuda:1 has 1.00 GiB free of 16.00 GiB" in check.reason
    assert check.fix.startswith("Either free memory held by other processes (nvidia-smi lists them)")


def test_enough_memory():
    check = check_memory(facts_with_free(GiB, 10 * GiB), estimate_training_memory(512 * MiB, "sgd"))
    assert check.verdict == "ok"
    assert check.reason.endswith("per replica; the GPU with the least free memory, cuda:0, has 1.00 GiB.")
    # Only the devices asked about count.
    assert check_memory(facts_with_free(GiB, 10 * GiB), estimate_training_memory(GiB, "adam"), [1]).verdict == "ok"


def test_memory_not_checked_without_gpus():
    check = check_memory(EnvironmentFacts(torch_version="2.13.0+cpu"), estimate_training_memory(GiB, "adam"))
    assert (check.verdict, check.reason) == ("ok", "Not checked: no GPU with known free memory.")


def test_ensure_fits_raises_with_both_numbers():
    with pytest.raises(
        MemoryEstimateError,
        match=r"needs at least 4\.00 GiB .* but cuda:0 has 1\.00 GiB free of "
        r"16\.00 GiB\. Either",
    ):
        ensure_fits(facts_with_free(GiB), estimate_training_memory(GiB, "adam"))
    ensure_fits(facts_with_free(10 * GiB), estimate_training_memory(GiB, "adam"))
