"""Readiness sections for training on a GPU: equivalence against one device, and overhead against plain torch.

Equivalence: the MLP and the digits CNN, Adam with gradient clipping, uneven batches (the last one
shorter than the replica count allows to split evenly), trained under each strategy and compared with
a plain PyTorch loop on one device. float32 with TF32 off must agree to 1e-5, float64 to 1e-9; with
TF32 on, and under bf16/fp16 autocast with a GradScaler, the deviation is reported (and bounded).
In a dry run the same cases run on CPU devices, float32 and float64.

Overhead: plain PyTorch against OneDevice, Mirrored on one GPU and fit, on the MLP and CNN
workloads, in interleaved blocks so drift hits every side alike; the median of the per-block ratios
is the figure (goal: at most 1.03), for pinned and for pageable input.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from readiness_sections import expect
from torch import nn

import stratagem as sg
from stratagem.bench.workloads import WORKLOADS
from stratagem.demo.digits import build_digits_model

STEPS_BATCHES = (64, 63, 37, 5)  # uneven: 63 and 37 split unevenly, 5 leaves some replicas 1 or 2 examples


def set_tf32(enabled: bool) -> None:
    """TF32 for matmuls and cuDNN convolutions, through the flags torch documents."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def cnn() -> nn.Module:
    return build_digits_model(seed=0)


def batches(model_name: str, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (32,) if model_name == "mlp" else (1, 8, 8)
    return [
        (torch.randn(n, *shape, generator=g).to(dtype), torch.randint(0, 10, (n,), generator=g)) for n in STEPS_BATCHES
    ]


BUILDERS = {"mlp": mlp, "cnn": cnn}


def _autocast(device_type: str, dtype: torch.dtype | None):
    return torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _step(
    model: Any, opt: Any, scaler: torch.amp.GradScaler, amp: torch.dtype | None, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """One step of the equivalence loop, on one device or per replica: the loss (under autocast with `amp`),
    backward through the GradScaler (which passes through when disabled), the gradient clipped to norm 1."""
    with _autocast(x.device.type, amp):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return loss.detach()


def reference(
    model_name: str, dtype: torch.dtype, device: str, amp: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """A plain PyTorch loop on one device: the expected parameters."""
    model = BUILDERS[model_name]().to(device=device, dtype=dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cuda", enabled=amp is not None)
    for x, y in batches(model_name, dtype):
        _step(model, opt, scaler, amp, x.to(device), y.to(device))
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def train(
    strategy: Any, model_name: str, dtype: torch.dtype, amp: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The same loop under a strategy: one script, the strategy's run() per global batch."""
    base = BUILDERS[model_name]().to(dtype=dtype)
    model, opt = strategy.distribute(base, torch.optim.Adam(base.parameters(), lr=1e-2))
    scaler = torch.amp.GradScaler("cuda", enabled=amp is not None)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _step(model, opt, scaler, amp, x, y)

    try:
        for x, y in strategy.distribute_dataset(batches(model_name, dtype)):
            strategy.run(step, args=(x, y))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    finally:
        strategy.close()


def deviation(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[k].double() - want[k].double()).abs().max()) for k in want)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_worker(devices: list[str]) -> Any:
    cluster = {"cluster": {"worker": [f"127.0.0.1:{_free_port()}"]}, "task": {"type": "worker", "index": 0}}
    return sg.MultiWorkerMirroredStrategy(devices, cluster=cluster, timeout=60)


def equivalence(ctx: Any) -> dict[str, Any]:
    gpu = not ctx.dry_run
    home = "cuda:0" if gpu else "cpu"
    if gpu:
        strategies: dict[str, Callable[[], Any]] = {
            "OneDevice cuda:0": lambda: sg.OneDeviceStrategy("cuda:0"),
            "Mirrored cuda:0": lambda: sg.MirroredStrategy(["cuda:0"]),
            "Mirrored cpu:0+cuda:0": lambda: sg.MirroredStrategy(["cpu:0", "cuda:0"]),
            "Mirrored cuda:0+cpu:0": lambda: sg.MirroredStrategy(["cuda:0", "cpu:0"]),
            "CentralStorage cuda:0, parameters on cpu": lambda: sg.CentralStorageStrategy(
                ["cuda:0"], parameter_device="cpu"
            ),
            "ModelParallel cuda:0|cpu:0, 3 micro-batches": lambda: sg.ModelParallelStrategy(
                ["cuda:0", "cpu:0"], num_micro_batches=3
            ),
            "MultiWorker one worker (NCCL)": lambda: _one_worker(["cuda:0"]),
        }
        models = ("mlp", "cnn")
    else:
        strategies = {
            "OneDevice cpu:0": lambda: sg.OneDeviceStrategy("cpu:0"),
            "Mirrored cpu:0+cpu:1": lambda: sg.MirroredStrategy(["cpu:0", "cpu:1"]),
            "CentralStorage cpu:0+cpu:1": lambda: sg.CentralStorageStrategy(["cpu:0", "cpu:1"]),
            "ModelParallel cpu:0|cpu:1, 2 micro-batches": lambda: sg.ModelParallelStrategy(
                ["cpu:0", "cpu:1"], num_micro_batches=2
            ),
            "MultiWorker one worker (Gloo)": lambda: _one_worker(["cpu:0"]),
        }
        models = ("mlp",)
    figures: dict[str, Any] = {}
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.float64, 1e-9)):
        if gpu:
            set_tf32(False)
        for model_name in models:
            want = reference(model_name, dtype, home)
            for label, build in strategies.items():
                if model_name == "cnn" and label.startswith("MultiWorker"):
                    continue  # one process group per model is enough; the MLP covers it

                def case(build=build, model_name=model_name, dtype=dtype, tolerance=tolerance, want=want) -> dict:
                    worst = deviation(train(build(), model_name, dtype), want)
                    expect(worst <= tolerance, f"parameters differ from one device by {worst:.3e} (> {tolerance:g})")
                    return {"max_difference": worst}

                figures[f"{model_name} {str(dtype)[6:]} {label}"] = ctx.case(
                    f"{model_name} {str(dtype)[6:]} {label}", case
                )
    if gpu:
        figures.update(_tf32_and_autocast(ctx))
    return figures


def _tf32_and_autocast(ctx: Any) -> dict[str, Any]:
    """TF32 on: the deviation from the TF32-off reference (reported, bounded loosely); bf16 and fp16 autocast
    with a GradScaler: one-GPU strategies against the same autocast loop on one device."""
    figures: dict[str, Any] = {}
    for model_name in ("mlp", "cnn"):
        set_tf32(False)
        exact = reference(model_name, torch.float32, "cuda:0")
        set_tf32(True)
        try:

            def tf32(model_name=model_name, exact=exact) -> dict[str, Any]:
                tf32_reference = reference(model_name, torch.float32, "cuda:0")
                got = train(sg.MirroredStrategy(["cuda:0"]), model_name, torch.float32)
                row = {
                    "strategy_vs_tf32_reference": deviation(got, tf32_reference),
                    "tf32_vs_exact_float32": deviation(tf32_reference, exact),
                }
                expect(row["strategy_vs_tf32_reference"] <= 1e-3, f"TF32 run deviates by {row}")
                return row

            figures[f"{model_name} TF32 on"] = ctx.case(f"{model_name} float32 with TF32 on", tf32)
        finally:
            set_tf32(False)
        for amp in (torch.bfloat16, torch.float16):

            def autocast(model_name=model_name, amp=amp) -> dict[str, Any]:
                want = reference(model_name, torch.float32, "cuda:0", amp=amp)
                row = {}
                for label, build in (
                    ("OneDevice", lambda: sg.OneDeviceStrategy("cuda:0")),
                    ("Mirrored cuda:0", lambda: sg.MirroredStrategy(["cuda:0"])),
                ):
                    row[label] = deviation(train(build(), model_name, torch.float32, amp=amp), want)
                expect(max(row.values()) <= 1e-3, f"autocast runs deviate from one device: {row}")
                return row

            figures[f"{model_name} autocast {str(amp)[6:]}"] = ctx.case(
                f"{model_name} autocast {str(amp)[6:]} with GradScaler", autocast
            )
    return figures


# ---- overhead ---------------------------------------------------------------------------------------


def overhead(ctx: Any) -> dict[str, Any]:
    gpu = not ctx.dry_run
    device = "cuda:0" if gpu else "cpu"
    blocks, steps = (9, 40) if gpu else (2, 1)
    figures: dict[str, Any] = {"blocks": blocks, "steps_per_block": steps, "goal": "median ratio <= 1.03"}
    for name in ("mlp", "cnn") if gpu else ("mlp",):  # the dry run shows the code runs, not its speed
        for pinned in (True, False) if gpu else (False,):
            label = f"{name} {'pinned' if pinned else 'pageable'} input"
            figures[label] = ctx.case(
                label,
                lambda name=name, pinned=pinned: _overhead_of(name, device, pinned, blocks, steps, enforce_goal=gpu),
            )
    return figures


def _overhead_of(
    name: str, device: str, pinned: bool, blocks: int, steps: int, *, enforce_goal: bool
) -> dict[str, Any]:
    workload = WORKLOADS[name]
    host = workload.make_batches()
    if pinned:
        host = [(x.pin_memory(), y.pin_memory()) for x, y in host]

    def plain_runner() -> Callable[[int], None]:
        model = workload.build_model().to(device)
        opt = workload.build_optimizer(model)

        def step(i: int) -> None:
            x, y = host[i % len(host)]
            x, y = x.to(device, non_blocking=pinned), y.to(device, non_blocking=pinned)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

        return step

    def strategy_runner(strategy: Any) -> Callable[[int], None]:
        base = workload.build_model()
        model, opt = strategy.distribute(base, workload.build_optimizer(base))

        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss

        def step(i: int) -> None:
            for x, y in strategy.distribute_dataset([host[i % len(host)]]):
                strategy.run(train_step, args=(x, y))

        return step

    def fit_runner() -> Callable[[int], None]:
        strategy = sg.OneDeviceStrategy(device if device != "cpu" else "cpu:0")
        base = workload.build_model()
        pair = strategy.distribute(base, workload.build_optimizer(base))

        def block(count: int) -> None:  # one fit call per block: fit's own set-up is part of what it costs
            sg.fit(strategy, pair[0], pair[1], F.cross_entropy, [host[i % len(host)] for i in range(count)], epochs=1)

        return block

    def per_step(step: Callable[[int], None]) -> Callable[[int], None]:
        def block(count: int) -> None:
            for i in range(count):
                step(i)

        return block

    runners = {
        "plain": per_step(plain_runner()),
        "OneDevice": per_step(strategy_runner(sg.OneDeviceStrategy(device if device != "cpu" else "cpu:0"))),
        "Mirrored one device": per_step(strategy_runner(sg.MirroredStrategy([device if device != "cpu" else "cpu:0"]))),
        "fit": fit_runner(),
    }
    times: dict[str, list[float]] = {k: [] for k in runners}
    for runner in runners.values():  # warm-up: kernels chosen, allocator filled
        runner(3)
    for _ in range(blocks):
        for key, runner in runners.items():  # interleaved, so drift touches every side alike
            _sync(device)
            start = time.perf_counter()
            runner(steps)
            _sync(device)
            times[key].append(time.perf_counter() - start)
    ratios = {
        k: round(statistics.median(t / p for t, p in zip(times[k], times["plain"])), 3) for k in runners if k != "plain"
    }
    row = {"plain_ms_per_step": round(1000 * statistics.median(times["plain"]) / steps, 3), "median_ratio": ratios}
    if enforce_goal:
        slow = {k: r for k, r in ratios.items() if r > 1.03}
        expect(not slow, f"slower than plain torch by more than 3%: {slow}")
    return row


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
