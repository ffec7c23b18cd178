"""Readiness sections for the CUDA plumbing: NCCL waits, CPU-first reduction, doctor, memory, older scripts.

Each section is `fn(ctx) -> figures`: it raises (or records a failed `ctx.case`) when something is
wrong. With ``ctx.dry_run`` it runs its CPU part only, so the script is exercised on machines
without a GPU. Only documented torch APIs are used, plus ``torch.cuda._sleep`` (to queue a long
kernel), guarded.
"""

from __future__ import annotations

import json
import logging
import os
import py_compile
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
GiB = 2**30


def expect(condition: bool, what: str) -> None:
    """An assertion that `python -O` keeps."""
    if not condition:
        raise AssertionError(what)


def _child_env(**changes: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _python(code: str, *, timeout: float, **env: str | None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_child_env(**env),
        check=False,
    )


# ---- NCCL waits ---------------------------------------------------------------------------------------


class _NeverDone:
    """A work handle whose collective never ends (the dry run's stand-in for one queued behind a long kernel)."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> bool:
        return True


def nccl_wait(ctx: Any) -> dict[str, Any]:
    """A one-worker group, a long kernel queued before the collective, then stratagem's wait, which under
    NCCL hands the handle to its watchdog instead of blocking the host: the wait must return before the
    kernel ends, the value read afterwards must be the collective's result, the watchdog must warn about
    the stall, and a collective that outlasts the timeout must be named by the watchdog's error."""
    from stratagem.collective.cross_worker import CrossWorker
    from stratagem.collective.watchdog import abort_process_group
    from stratagem.errors import CollectiveTimeoutError

    on_gpu = not ctx.dry_run
    backend = "nccl" if on_gpu else "gloo"
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    store = dist.FileStore(str(ctx.out / f"nccl_wait_store_{os.getpid()}"), 1)
    options = {"device_id": device} if on_gpu else {}
    if on_gpu:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, **options)
    figures: dict[str, Any] = {"backend": backend}
    try:
        cw = CrossWorker(
            store, rank=0, task_names=["worker:0"], timeout=60.0, stall_warning_after=0.1, device_collectives=on_gpu
        )
        warnings: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                warnings.append(record.getMessage())

        logging.getLogger("stratagem.collective.cross_worker").addHandler(Keep())

        def gather_after_a_long_kernel() -> dict[str, Any]:
            n = 1 << 22
            x = torch.ones(n, device=device)
            out = torch.zeros(n, device=device)
            if on_gpu:
                torch.cuda.synchronize()
                torch.cuda._sleep(int(2e9))  # about a second of GPU time, queued before the collective
            x.mul_(2.0)
            start = time.perf_counter()
            work = dist.all_gather_into_tensor(out, x, async_op=True) if on_gpu else dist.all_reduce(x, async_op=True)
            queued = {
                "future_done_when_queued": bool(work.get_future().done()),
                "is_completed_when_queued": bool(work.is_completed()),
            }
            cw.wait([work], what="readiness all-gather", step=0)
            returned = time.perf_counter() - start
            result = out if on_gpu else x
            low, high = float(result.min()), float(result.max())  # a host read: waits for the GPU, after the wait
            read = time.perf_counter() - start
            cw.check()
            expect(low == high == 2.0, f"read {low}..{high} after the wait, expected 2.0 everywhere")
            if on_gpu:
                expect(
                    returned < 0.5,
                    f"the wait blocked the host for {returned:.3f} s, though NCCL's wait() only orders the stream",
                )
                expect(read > 0.2, f"the read returned after {read:.3f} s, before the queued kernel could end")
                expect(
                    any("has waited" in w for w in warnings),
                    "no stall warning from the watchdog although the "
                    f"collective took {read:.2f} s past the 0.1 s warning threshold",
                )
            return {
                **queued,
                "wait_returned_s": round(returned, 3),
                "read_s": round(read, 3),
                "value": low,
                "stall_warned": bool(warnings),
            }

        figures["gather_after_long_kernel"] = ctx.case(
            "collective after a long queued kernel", gather_after_a_long_kernel
        )

        def all_reduce_through_stratagem() -> dict[str, Any]:
            y = torch.full((1 << 20,), 3.0, device=device)
            if on_gpu:
                torch.cuda._sleep(int(5e8))
            y.add_(1.0)
            cw.all_reduce_([y], what="readiness all-reduce", step=1)
            value = float(y[-1])
            cw.check()
            expect(value == 4.0, f"read {value} after all_reduce_, expected 4.0")
            return {"value": value}

        figures["all_reduce"] = ctx.case("all_reduce_ waits for its own result", all_reduce_through_stratagem)

        def a_stuck_collective_is_named_by_the_watchdog() -> dict[str, Any]:
            aborts: list[float] = []
            stuck = CrossWorker(
                store,
                rank=0,
                task_names=["worker:0"],
                timeout=0.5,
                stall_warning_after=0.1,
                roll_call_seconds=0.2,
                device_collectives=True,
                abort=lambda: aborts.append(time.perf_counter()),
            )
            try:
                z = torch.ones(1 << 10, device=device)
                if on_gpu:
                    torch.cuda._sleep(int(6e9))  # a few seconds: the all-reduce outlasts the 0.5 s timeout
                    work = dist.all_reduce(z, async_op=True)
                else:
                    work = _NeverDone()
                start = time.perf_counter()
                stuck.wait([work], what="readiness all-reduce", step=7)
                error: Exception | None = None
                while error is None and time.perf_counter() - start < 5.0:
                    try:
                        stuck.check()
                    except CollectiveTimeoutError as raised:
                        error = raised
                    time.sleep(0.01)
                named = time.perf_counter() - start
                expect(error is not None, "the watchdog recorded no error within 5 s of a 0.5 s timeout")
                expect("every task answered the roll call" in str(error), f"unexpected error: {error}")
                expect(len(aborts) == 1, f"the abort was called {len(aborts)} times, expected once")
                return {"named_after_s": round(named, 3), "error": str(error)[:200]}
            finally:
                stuck.close()
                if on_gpu:
                    torch.cuda.synchronize()

        figures["stuck"] = ctx.case(
            "a stuck collective is named by the watchdog", a_stuck_collective_is_named_by_the_watchdog
        )

        if on_gpu:

            def the_abort_runs_on_nccl() -> dict[str, Any]:
                abort_process_group()  # the real one (experimental in torch): the group must be gone after it
                expect(not dist.is_initialized(), "the process group is still initialized after the abort")
                return {"aborted": True}

            figures["abort"] = ctx.case("the process group's abort runs under NCCL", the_abort_runs_on_nccl)
        cw.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return figures


# ---- the CPU-first reduction --------------------------------------------------------------------------


def cpu_first_reduction(ctx: Any) -> dict[str, Any]:
    """ReduceToOneDevice with replica 0 on the CPU and replica 1 on the GPU, 64 MiB of gradients, against
    the sum computed from blocking copies; the GPU gradient is written by a kernel queued behind a long one."""
    from stratagem.collective.local import ReduceToOneDevice

    other = torch.device("cpu") if ctx.dry_run else torch.device("cuda", 0)
    n = (1 << 18) if ctx.dry_run else (16 << 20)  # 1 MiB / 64 MiB of float32
    figures: dict[str, Any] = {"elements": n, "other_device": str(other)}
    worst = 0.0
    for trial in range(3):
        cpu_grad = torch.full((n,), float(trial + 1))
        gpu_grad = torch.zeros(n, device=other)
        if other.type == "cuda":
            torch.cuda._sleep(int(3e8))
        gpu_grad.add_(torch.arange(n, device=other, dtype=torch.float32) % 7)  # lands after the sleep
        expected = cpu_grad + (torch.arange(n, dtype=torch.float32) % 7)
        ReduceToOneDevice().combine_(0, [[cpu_grad], [gpu_grad]], [0.5, 0.5])
        worst = max(worst, float((cpu_grad - expected).abs().max()), float((gpu_grad.cpu() - expected).abs().max()))
    expect(worst == 0.0, f"the CPU-first sum differs from the exact sum by {worst}")
    figures["max_difference"] = worst
    return figures


# ---- the doctor under each CUDA_VISIBLE_DEVICES -------------------------------------------------------

_TORCH_SEES = "import torch, json; print(json.dumps([torch.cuda.is_available(), torch.cuda.device_count() if torch.cuda.is_available() else 0]))"


def doctor(ctx: Any) -> dict[str, Any]:
    """Each CUDA_VISIBLE_DEVICES form: the doctor's prediction of the visible count against what torch sees
    in a fresh process, and the doctor's exit code (0 or 1, never a crash)."""
    from stratagem.diagnose import EnvironmentFacts, collect_facts, visible_by_cuda_visible_devices

    base = collect_facts({})
    uuid = next((u for u in base.nvml_uuids or [] if u.startswith("GPU-")), None)
    if ctx.dry_run:  # a constructed one-GPU machine, and the real (GPU-less) one
        uuid = "GPU-8f6b1d0e-1c2f-4a5b-9c3d-2e1f0a9b8c7d"
        base = EnvironmentFacts(
            torch_version="2.13.0+cu128",
            torch_cuda_version="12.8",
            driver_present=True,
            driver_version="570.86.15",
            nvml_device_count=1,
            nvml_uuids=[uuid],
            torch_device_count=1,
        )
    values: list[tuple[str, str | None, int | None]] = [  # (label, value, GPUs torch should see on one GPU)
        ("unset", None, None),
        ("empty", "", 0),
        ("-1", "-1", 0),
        ("0", "0", 1),
        ("0,0", "0,0", 0),
        ("bogus UUID", "GPU-bogus", 0),
        ("bogus MIG UUID", "MIG-11111111-2222-3333-4444-555555555555", 0),
        ("0,GPU-x", "0,GPU-x", 1),
    ]
    if uuid is not None:
        values.insert(5, ("real UUID", uuid, 1))
    figures: dict[str, Any] = {"uuid": uuid}
    for label, value, one_gpu in values:

        def one(value: str | None = value, one_gpu: int | None = one_gpu) -> dict[str, Any]:
            import dataclasses

            facts = dataclasses.replace(base, cuda_visible_devices=value)
            predicted = visible_by_cuda_visible_devices(facts)
            predicted = (
                (facts.nvml_device_count or 0) if predicted is None else min(predicted, facts.nvml_device_count or 0)
            )
            row: dict[str, Any] = {"value": value, "doctor_predicts": predicted}
            if ctx.dry_run:
                expected = 1 if one_gpu is None else one_gpu
                expect(predicted == expected, f"the doctor predicts {predicted} GPU(s), CUDA shows {expected}")
                return row
            seen = _python(_TORCH_SEES, timeout=60, CUDA_VISIBLE_DEVICES=value)
            available, count = json.loads(seen.stdout.strip().splitlines()[-1])
            report = subprocess.run(
                [sys.executable, "-m", "stratagem", "doctor", "--json", "--no-smoke-test"],
                capture_output=True,
                text=True,
                timeout=90,
                check=False,
                env=_child_env(CUDA_VISIBLE_DEVICES=value),
            )
            parsed = json.loads(report.stdout)
            row.update(
                torch_sees=count,
                torch_available=available,
                doctor_exit=report.returncode,
                verdicts={c["name"]: c["verdict"] for c in parsed["checks"] if c["verdict"] != "ok"},
            )
            expect(report.returncode in (0, 1), f"the doctor exited {report.returncode}: {report.stderr[-2000:]}")
            expect(predicted == count, f"the doctor predicts {predicted} GPU(s), torch sees {count}")
            return row

        figures[label] = ctx.case(f"CUDA_VISIBLE_DEVICES {label}", one)

    def doctor_process() -> dict[str, Any]:
        report = subprocess.run(
            [sys.executable, "-m", "stratagem", "doctor", "--json", "--no-smoke-test"],
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
            env=_child_env(),
        )
        expect(report.returncode in (0, 1), f"the doctor exited {report.returncode}: {report.stderr[-2000:]}")
        return {"exit": report.returncode, "blocking": json.loads(report.stdout)["blocking"]}

    if ctx.dry_run:
        figures["doctor on this machine"] = ctx.case("stratagem doctor --json on this machine", doctor_process)
    return figures


# ---- memory ---------------------------------------------------------------------------------------------

_CPU_STRATEGY_CONTEXT = """
import json, torch, stratagem as sg
strategy = sg.MirroredStrategy(["cpu:0", "cpu:1"])
net = torch.nn.Linear(4, 2)
model, opt = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.1))
def step(x):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
for x in strategy.distribute_dataset([torch.ones(4, 4)]):
    strategy.run(step, args=(x,))
strategy.close()
print(json.dumps({"cuda_initialized": torch.cuda.is_initialized()}))
"""


def memory(ctx: Any) -> dict[str, Any]:
    """A logical device's limit (enforced, or a planning figure), no CUDA context from a CPU-only strategy,
    and the room figure after a large tensor is freed (the allocator's cache counted as room)."""
    import stratagem as sg
    from stratagem.devices import DeviceRegistry, LogicalDeviceConfiguration, PhysicalDevice

    figures: dict[str, Any] = {}

    def limit() -> dict[str, Any]:
        if ctx.dry_run:
            registry = DeviceRegistry(
                physical=[
                    PhysicalDevice(device_type="cpu", name="cpu", core_count=2),
                    PhysicalDevice(device_type="cuda", index=0, name="H200", total_memory=141 * GiB),
                ]
            )
        else:
            registry = DeviceRegistry()
        registry.set_logical_device_configuration("cuda:0", [LogicalDeviceConfiguration(memory_limit=4 * GiB)])
        strategy = sg.MirroredStrategy(["cuda:0"], registry=registry)
        decision = next(d for d in strategy.explain().decisions if d.subject == "GPU memory limit")
        row: dict[str, Any] = {"choice": decision.choice, "reason": decision.reason}
        try:
            if ctx.dry_run:
                expect(decision.choice == "planning figure on cuda:0", f"without CUDA: {decision.choice}")
                return row
            expect(decision.choice == "enforced on cuda:0", decision.choice)
            small = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda:0")
            try:
                torch.empty(3 * GiB, dtype=torch.uint8, device="cuda:0")
                refused = False
            except torch.OutOfMemoryError:
                refused = True
            del small
            row["allocation_past_limit_refused"] = refused
            expect(refused, "5 GiB in all were allocated under a 4 GiB limit")
            return row
        finally:
            strategy.close()
            if not ctx.dry_run:
                torch.cuda.set_per_process_memory_fraction(1.0, 0)
                torch.cuda.empty_cache()

    figures["logical device limit"] = ctx.case("a logical GPU's memory limit", limit)

    def no_context() -> dict[str, Any]:
        result = _python(_CPU_STRATEGY_CONTEXT, timeout=120)
        expect(result.returncode == 0, result.stderr[-2000:])
        seen = json.loads(result.stdout.strip().splitlines()[-1])
        expect(not seen["cuda_initialized"], "a CPU-only MirroredStrategy started CUDA (a context on GPU 0)")
        return seen

    figures["cpu strategy context"] = ctx.case("a CPU-only strategy leaves CUDA unstarted", no_context)

    def room_after_free() -> dict[str, Any]:
        from stratagem.devices import LogicalDevice

        device = LogicalDevice(
            name="cuda:0" if not ctx.dry_run else "cpu:0",
            physical=torch.device("cuda", 0) if not ctx.dry_run else torch.device("cpu"),
        )
        if ctx.dry_run:
            expect(device.memory_room() is None, "a CPU device has no GPU room figure")
            return {"room": None}
        big = torch.empty(8 * GiB, dtype=torch.uint8, device="cuda:0")
        del big  # kept by the caching allocator, free for the next tensor
        free = torch.cuda.mem_get_info(0)[0]
        room, what = device.memory_room()
        torch.cuda.empty_cache()
        expect(
            room - free >= 7 * GiB, f"the room ({room}) does not count the 8 GiB cached after the free ({free} free)"
        )
        return {"mem_get_info_free_GiB": round(free / GiB, 2), "room_GiB": round(room / GiB, 2), "what": what}

    figures["room after a free"] = ctx.case("the room figure after a large tensor is freed", room_after_free)
    return figures


# ---- the older GPU scripts and pytest -m gpu -------------------------------------------------------------

SCRIPTS = ("check_cuda.py", "check_placement.py", "check_strategies.py")


def existing_scripts(ctx: Any) -> dict[str, Any]:
    """tests/gpu's other scripts, then `pytest -m gpu`; in a dry run, that each script compiles and that
    pytest knows the gpu marker."""
    figures: dict[str, Any] = {}
    for script in SCRIPTS:

        def one(script: str = script) -> dict[str, Any]:
            if ctx.dry_run:
                py_compile.compile(str(HERE / script), doraise=True, cfile=str(ctx.out / f"{script}.pyc"))
                return {"compiled": True}
            start = time.perf_counter()
            result = subprocess.run(
                [sys.executable, str(HERE / script)],
                capture_output=True,
                text=True,
                timeout=100,
                env=_child_env(),
                cwd=str(ROOT),
                check=False,
            )
            print(result.stdout[-8000:], result.stderr[-4000:], flush=True)
            expect(result.returncode == 0, f"{script} exited {result.returncode}: {result.stdout[-1500:]}")
            return {"exit": result.returncode, "seconds": round(time.perf_counter() - start, 1)}

        figures[script] = ctx.case(script, one)

    def marked() -> dict[str, Any]:
        if ctx.dry_run:
            text = (ROOT / "pyproject.toml").read_text()
            expect('"gpu: needs a CUDA GPU' in text, "pyproject.toml does not register the gpu marker")
            return {"marker_registered": True}
        command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=150, env=_child_env(), cwd=str(ROOT), check=False
        )
        print(result.stdout[-8000:], flush=True)
        expect(result.returncode == 0, f"pytest -m gpu exited {result.returncode}: {result.stdout[-1500:]}")
        return {"exit": result.returncode, "summary": result.stdout.strip().splitlines()[-1:]}

    figures["pytest -m gpu"] = ctx.case("pytest -m gpu", marked)
    return figures
