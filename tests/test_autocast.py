"""Mixed precision: autocast reaches every replica thread and pipeline stage; bf16 training matches one
device under the same autocast; torch.amp.GradScaler keeps one scale and skips an overflowing step on every
replica; fit and `stratagem train` take a precision setting.

bf16 tolerance: bfloat16 keeps 8 significant bits (machine epsilon 2**-7 = 0.0078). Under autocast each
replica's weight gradients are rounded to bf16 per slice (and the loss divided by the slice's size, not the
global batch's), so they differ from one device's by about one bf16 rounding. We require every parameter
tensor to lie within 2**-7 times its largest magnitude of one device's (measured on the MLP below after 5
SGD-momentum steps: at most 1.2e-3 of it, for every strategy here).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from amp_cases import BF16_EPS, overflow_batches, train_bf16, train_scaled
from cases import make_batches, mlp
from conftest import cpu_registry
from helpers import launch_workers
from in_process_strategies import STRATEGIES as IN_PROCESS
from torch import nn

import stratagem as sg
from stratagem.cli.main import main

STRATEGIES = {
    **IN_PROCESS,
    "model-parallel-2": lambda: sg.ModelParallelStrategy(
        ["cpu:0", "cpu:1"], num_micro_batches=2, registry=cpu_registry(3)
    ),
}


def _bf16(enabled: bool = True):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


@pytest.mark.parametrize("where", ["around-run", "inside-step"])
@pytest.mark.parametrize("name", ["mirrored-3", "central-3", "mirrored-3-copies"])
def test_autocast_reaches_every_replica_thread(name, where):
    strategy = STRATEGIES[name]()
    model = strategy.distribute(nn.Linear(3, 2))
    (x,) = list(strategy.distribute_dataset([torch.ones(6, 3)]))

    def step(x):
        if where == "inside-step":
            with _bf16():
                return torch.is_autocast_enabled("cpu"), model(x).dtype
        return torch.is_autocast_enabled("cpu"), model(x).dtype

    if where == "around-run":
        with _bf16():
            enabled, dtypes = strategy.run(step, args=(x,))
    else:
        enabled, dtypes = strategy.run(step, args=(x,))
    assert list(strategy.experimental_local_results(enabled)) == [True] * 3
    assert list(strategy.experimental_local_results(dtypes)) == [torch.bfloat16] * 3
    # ... and does not outlive the step: the next run without autocast computes in float32 everywhere.
    _, dtypes = strategy.run(lambda x: (None, model(x).dtype), args=(x,))
    assert list(strategy.experimental_local_results(dtypes)) == [torch.float32] * 3
    strategy.close()


def test_pipeline_stages_compute_under_the_callers_autocast():
    strategy = STRATEGIES["model-parallel-2"]()
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    seen = []
    for layer in net:
        layer.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    model = strategy.distribute(net)
    with _bf16():
        out = strategy.run(lambda x: model(x), args=(torch.ones(4, 3),))
    assert out.dtype == torch.bfloat16
    assert seen == [torch.bfloat16] * 4  # 2 stages x 2 micro-batches, each on a stage thread
    strategy.close()


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_bf16_training_matches_one_device_under_the_same_autocast(name):
    batches = make_batches((6,), torch.float32)
    expected = train_bf16(None, batches)
    strategy = STRATEGIES[name]()
    got = train_bf16(strategy, batches)
    for key, value in expected.items():
        error = (got[key] - value).abs().max().item()
        assert error <= BF16_EPS * value.abs().max().item(), f"{key}: {error}"
    strategy.close()


@pytest.mark.parametrize("name", ["one-device", "mirrored-3", "mirrored-3-copies", "central-3"])
def test_grad_scaler_keeps_one_scale_and_an_overflow_in_one_replica_skips_the_step_everywhere(name):
    batches = overflow_batches()
    expected, ref_scales = train_scaled(None, batches)
    # The reference skipped step 1 and halved its scale; it grew again after two clean steps.
    assert [s[0] for s in ref_scales] == [2.0**10, 2.0**9, 2.0**9, 2.0**10]
    strategy = STRATEGIES[name]()
    got, scales = train_scaled(strategy, batches)
    assert scales == [s * len(scales[0]) for s in ref_scales]  # every replica holds the same scale
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6)
    strategy.close()


def test_distribute_scaler_refuses_what_is_not_a_grad_scaler():
    strategy = STRATEGIES["mirrored-2"]()
    with pytest.raises(sg.InputError, match=r"takes a torch.amp.GradScaler. Received: dict"):
        strategy.distribute_scaler({})
    strategy.close()


def _fit(strategy, precision):
    torch.manual_seed(42)
    net = mlp()
    x, y = torch.randn(40, 6, generator=torch.Generator().manual_seed(1)), torch.arange(40) % 4
    history = sg.fit(
        strategy,
        net,
        torch.optim.SGD(net.parameters(), lr=0.1),
        F.cross_entropy,
        (x, y),
        batch_size=10,
        shuffle=False,
        precision=precision,
    )
    return history.model.state_dict(), history.history["loss"]


def test_fit_bf16_matches_one_device_and_differs_from_float32():
    ref, ref_loss = _fit(sg.OneDeviceStrategy("cpu"), "bf16")
    fp32, _ = _fit(sg.OneDeviceStrategy("cpu"), "32")
    assert any(not torch.equal(fp32[k], ref[k]) for k in ref)  # bf16 really ran
    strategy = STRATEGIES["mirrored-3"]()
    got, loss = _fit(strategy, "bf16")
    for key, value in ref.items():
        assert (got[key] - value).abs().max().item() <= BF16_EPS * value.abs().max().item(), key
    assert loss == pytest.approx(ref_loss, rel=BF16_EPS)
    strategy.close()


def test_fit_refuses_fp16_on_the_cpu_and_unknown_precisions():
    strategy = STRATEGIES["mirrored-2"]()
    net = mlp()
    data = (torch.randn(8, 6), torch.zeros(8, dtype=torch.long))
    with pytest.raises(sg.InputError, match=r"precision='fp16' needs loss scaling .* on cpu\. Use precision='bf16'"):
        sg.fit(
            strategy,
            net,
            torch.optim.SGD(net.parameters(), lr=0.1),
            F.cross_entropy,
            data,
            batch_size=4,
            precision="fp16",
        )
    with pytest.raises(sg.InputError, match=r"Unknown precision. Received: precision='16'"):
        sg.fit(
            strategy,
            net,
            torch.optim.SGD(net.parameters(), lr=0.1),
            F.cross_entropy,
            data,
            batch_size=4,
            precision="16",
        )
    strategy.close()


@pytest.mark.timeout(120)
def test_stratagem_train_refuses_fp16_on_the_cpu_before_training(capsys):
    assert main(["train", "--precision", "fp16", "--epochs", "1"]) == 2
    captured = capsys.readouterr()
    assert "--precision fp16 needs loss scaling" in captured.err and "--precision bf16" in captured.err
    assert "Traceback" not in captured.err


@pytest.mark.timeout(120)
def test_stratagem_train_runs_in_bf16(capsys):
    assert main(["train", "--json", "--precision", "bf16", "--epochs", "1", "--batch-size", "500"]) == 0
    import json

    summary = json.loads(capsys.readouterr().out)
    assert summary["config"]["precision"] == "bf16"
    assert summary["test_accuracy"] > 0.5


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_workers_train_in_bf16_and_share_one_loss_scale(tmp_path):
    out = tmp_path / "result.pt"
    exit_code, output = launch_workers("mwms_amp.py", {"MW_OUT": str(out)}, timeout=280)
    assert exit_code == 0, output
    saved = torch.load(out)
    expected_bf16 = train_bf16(None, make_batches((6,), torch.float32))
    expected_scaled, ref_scales = train_scaled(None, overflow_batches())
    for local in (1, 2):
        got = saved[(local, "bf16")]
        for key, value in expected_bf16.items():
            assert (got[key] - value).abs().max().item() <= BF16_EPS * value.abs().max().item(), (local, key)
        state, scales = saved[(local, "scaled")]
        assert scales == [s * local for s in ref_scales]  # the overflow in worker 1 skipped the chief's step too
        for key, value in expected_scaled.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)


def test_a_plain_grad_scaler_shared_by_replicas_is_refused_with_the_fix():
    strategy = STRATEGIES["mirrored-2"]()
    net = mlp()
    model, opt = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1))
    scaler = torch.amp.GradScaler("cpu")

    def step(x, y):
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()

    ((x, y),) = list(strategy.distribute_dataset(make_batches((6,), torch.float32, sizes=[4])))
    with pytest.raises(sg.InputError, match=r"GradScaler was called by several replicas .* strategy.distribute_scaler"):
        strategy.run(step, args=(x, y))
    strategy.close()
