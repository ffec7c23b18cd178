"""GPU check for stratagem.devices and stratagem.diagnose: run on a machine with a CUDA GPU.

    python tests/gpu/check_cuda.py

Exercises the CUDA paths a CPU-only machine cannot: discovery (name, memory, capability),
environment facts from the real driver, the checks on them, logical GPU splits, the memory
estimate against what torch really allocates, and the doctor's smoke test on the GPUs.
Prints one line per check and exits 1 if any failed. Takes well under a minute.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable

import torch

from stratagem import environ
from stratagem.cli.doctor import build_report
from stratagem.devices import (
    DeviceRegistry,
    LogicalDeviceConfiguration,
    physical_devices,
    resolve_devices,
)
from stratagem.diagnose import (
    check_environment,
    check_memory,
    collect_facts,
    ensure_fits,
    estimate_training_memory,
    gpu_unavailable_reason,
)
from stratagem.errors import DeviceError, MemoryEstimateError

RESULTS: list[tuple[str, bool, str]] = []


def check(name: str) -> Callable[[Callable[[], str]], Callable[[], str]]:
    """Runs the decorated function now; it returns a detail line or raises on failure."""

    def decorate(fn: Callable[[], str]) -> Callable[[], str]:
        start = time.perf_counter()
        try:
            detail, passed = fn(), True
        except Exception as error:  # noqa: BLE001 - a check script reports every failure
            detail, passed = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=3)}", False
        RESULTS.append((name, passed, detail))
        print(f"[{'PASS' if passed else 'FAIL'}] {name} ({time.perf_counter() - start:.1f}s): {detail}", flush=True)
        return fn

    return decorate


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def main() -> int:
    facts = collect_facts(environ.current())
    print("facts:", json.dumps(facts.to_dict(), indent=2))
    if not torch.cuda.is_available():
        reason = gpu_unavailable_reason(facts)
        print(f"No GPU is usable here, so nothing to check: {reason.message if reason else 'unknown reason'}")
        return 1
    count = torch.cuda.device_count()

    @check("facts match torch and the driver")
    def _() -> str:
        expect(
            facts.is_cuda_build and facts.torch_device_count == count, f"torch_device_count={facts.torch_device_count}"
        )
        expect(facts.driver_present and facts.driver_cuda_version is not None, "libcuda's cuDriverGetVersion not read")
        expect(len(facts.gpus) == count, f"{len(facts.gpus)} GPU facts for {count} GPUs")
        expect(facts.cudnn_available == torch.backends.cudnn.is_available(), "cuDNN availability differs")
        return (
            f"driver {facts.driver_version} (CUDA {facts.driver_cuda_version}), runtime "
            f"{facts.cuda_runtime_version}, NVML count {facts.nvml_device_count}, NCCL {facts.nccl_version}, "
            f"cuDNN {facts.cudnn_version}"
        )

    @check("physical GPU discovery")
    def _() -> str:
        gpus = [d for d in physical_devices() if d.device_type == "cuda"]
        expect(len(gpus) == count, f"{len(gpus)} physical GPUs, torch has {count}")
        for gpu in gpus:
            props = torch.cuda.get_device_properties(gpu.index)
            expect(gpu.name == props.name and gpu.total_memory == props.total_memory, f"{gpu} vs {props}")
            expect(gpu.capability == torch.cuda.get_device_capability(gpu.index), f"capability {gpu.capability}")
            expect(0 < gpu.free_memory <= gpu.total_memory, f"free {gpu.free_memory} of {gpu.total_memory}")
        return "; ".join(f"{g.torch_name} {g.name} {g.total_memory / 2**30:.1f} GiB cc {g.capability}" for g in gpus)

    @check("no check blocks training on this GPU machine")
    def _() -> str:
        checks = check_environment(facts, requested_gpus=list(range(count)))
        problems = [c.message for c in checks if c.verdict == "problem"]
        expect(not problems, f"problems: {problems}")
        return ", ".join(f"{c.name}={c.verdict}" for c in checks)

    @check("resolve GPU names and reject out-of-range ones")
    def _() -> str:
        registry = DeviceRegistry()
        resolved = resolve_devices(["/gpu:0", f"cuda:{count - 1}"] if count > 1 else ["/gpu:0"], registry)
        expect(resolved[0].physical == torch.device("cuda", 0), f"{resolved[0]}")
        try:
            resolve_devices([f"cuda:{count}"], DeviceRegistry())
        except DeviceError as error:
            expect("is out of range" in str(error), str(error))
        else:
            raise AssertionError(f"cuda:{count} resolved on a machine with {count} GPU(s)")
        return ", ".join(d.name for d in resolved)

    @check("split GPU 0 into two logical GPUs with memory limits")
    def _() -> str:
        registry = DeviceRegistry()
        total = registry.physical_devices()[1].total_memory
        registry.set_logical_device_configuration("cuda:0", [LogicalDeviceConfiguration(memory_limit=total // 4)] * 2)
        logical = registry.get_logical_devices("cuda")
        expect([d.physical.index for d in logical[:2]] == [0, 0], f"{logical}")
        expect(len(logical) == count + 1, f"{len(logical)} logical GPUs from {count} physical")
        return ", ".join(f"{d.name}->{d.physical}" for d in logical)

    @check("memory estimate is a lower bound of what Adam training allocates")
    def _() -> str:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(0)
        model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048)).cuda(0)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.randn(8, 2048, device="cuda:0")).sum().backward()
        optimizer.step()
        used = torch.cuda.memory_allocated(0) - base
        estimate = estimate_training_memory(model, optimizer)
        expect(estimate.total_bytes <= used, f"estimate {estimate.total_bytes} > allocated {used}")
        expect(used < 1.5 * estimate.total_bytes, f"allocated {used} is far above estimate {estimate.total_bytes}")
        del model, optimizer
        return f"estimate {estimate.total_bytes} B, allocated {used} B"

    @check("memory check on real free memory")
    def _() -> str:
        fits = check_memory(facts, estimate_training_memory(2**20, "adam"))
        expect(fits.verdict == "ok", fits.message)
        huge = estimate_training_memory(max(g.total_memory for g in facts.gpus), "adam")
        too_big = check_memory(facts, huge)
        expect(too_big.verdict == "problem", too_big.message)
        try:
            ensure_fits(facts, huge)
        except MemoryEstimateError as error:
            return f"ok for 1 MiB of parameters; for {huge.total_bytes} B: {error}"
        raise AssertionError("ensure_fits did not raise for a model four times the GPU")

    @check("doctor report and smoke test on the default GPUs")
    def _() -> str:
        report = build_report(facts)
        expect(report.devices == [f"cuda:{i}" for i in range(count)], f"devices {report.devices}")
        failed = [s for s in report.smoke if s.passed is not True]
        expect(not failed, f"smoke steps not passed: {failed}")
        expect(report.exit_code == 0, f"exit code {report.exit_code}: {report.to_dict()['blocking']}")
        return "; ".join(f"{s.name}: {s.detail}" for s in report.smoke)

    failed = [name for name, passed, _ in RESULTS if not passed]
    print(f"\n{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
