"""GPU check for the placement log and soft placement: run on a machine with a CUDA GPU (under a minute).

    python tests/gpu/check_placement.py

Checks what a CPU-only machine cannot: host <-> GPU copies counted with their bytes (worked out by
hand below), backward operations run by torch's CUDA autograd thread attributed to the replica,
an operation on the CPU inside a GPU replica reported as off its device, the replica threads of
MirroredStrategy over cuda:0 + cpu:0, and a CPU-only custom operation called on CUDA tensors:
PlacementError without soft placement, the right values (forward and backward) with it. Prints
one line per check (and the summaries) and exits 1 if any failed.
"""

from __future__ import annotations

import sys
import threading
import time

import torch
import torch.nn.functional as F
from harness import Checks, expect
from torch import nn

import stratagem as sg
from stratagem.diagnose.soft_placement import as_placement_error

CHECKS = Checks()


# ---- a CPU-only custom operation (no CUDA kernel), with a backward through another CPU-only op ----
@torch.library.custom_op("placement_check::square", mutates_args=(), device_types="cpu")
def square(x: torch.Tensor) -> torch.Tensor:
    return x * x


@torch.library.custom_op("placement_check::cube", mutates_args=(), device_types="cpu")
def cube(x: torch.Tensor) -> torch.Tensor:
    return x * x * x


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * 3 * square(x)


cube.register_autograd(_backward, setup_context=_setup_context)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


SIZES = (64, 48)  # two steps


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)) for n in SIZES]


def train_logged(strategy):
    base = net()
    model, optimizer = strategy.distribute(base, torch.optim.SGD(base.parameters(), lr=0.1))
    stacks = []

    def step(x, y):
        stacks.append((threading.current_thread().name, torch._C._len_torch_dispatch_stack()))
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        host = loss.detach().cpu()  # one float32 back to the host per replica: 4 B
        return host * 2  # an operation on the CPU inside the replica

    with sg.log_placement() as log:
        for x, y in strategy.distribute_dataset(batches()):
            strategy.run(step, args=(x, y))
    return log, stacks


def one_device_log():
    log, _ = train_logged(sg.OneDeviceStrategy("cuda:0"))
    summary = log.summary()
    print(summary, flush=True)
    expect(summary.steps == 2, f"steps: {summary.steps}")
    # Host -> GPU: each batch's x (n x 32 float32) and y (n int64), moved by distribute_dataset.
    to_gpu = sum(n * 32 * 4 + n * 8 for n in SIZES)
    copies = {(c.source, c.destination): (c.count, c.num_bytes) for c in summary.copies}
    expect(
        copies.get(("cpu", "cuda:0")) == (4, to_gpu),
        f"cpu -> cuda:0 {copies.get(('cpu', 'cuda:0'))}, want (4, {to_gpu})",
    )
    expect(copies.get(("cuda:0", "cpu")) == (2, 8), f"cuda:0 -> cpu {copies.get(('cuda:0', 'cpu'))}, want (2, 8)")
    # Backward runs on torch's CUDA autograd thread; its operations still belong to replica 0.
    expect(log.count(op="aten::threshold_backward", device="cuda:0", replica=0) == 2, "threshold_backward on cuda:0")
    expect(log.count(op="aten::threshold_backward", replica=None) == 0, "backward ops outside the replica")
    cpu_muls = [o for o in summary.off_device if o.op == "aten::mul" and o.device == "cpu"]
    expect(
        len(cpu_muls) == 1 and cpu_muls[0].count == 2 and cpu_muls[0].replica_device == "cuda:0",
        f"the CPU mul inside the GPU replica: {summary.off_device}",
    )
    return f"{summary.num_operations} ops, {summary.num_copies} copies, {summary.copy_bytes} B, off-device {summary.num_off_device}"


def mirrored_gpu_and_cpu_log():
    strategy = sg.MirroredStrategy(["cuda:0", "cpu:0"])
    try:
        log, stacks = train_logged(strategy)
        # Without a log no replica thread has a mode; with one, each has exactly one.
        expect(all(depth == 1 for _, depth in stacks), f"dispatch modes per replica step: {stacks}")
    finally:
        strategy.close()
    summary = log.summary()
    print(summary, flush=True)
    expect(log.count(op="aten::threshold_backward", device="cuda:0", replica=0) == 2, "replica 0 backward on cuda:0")
    expect(log.count(op="aten::threshold_backward", device="cpu", replica=1) == 2, "replica 1 backward on the CPU")
    return f"per replica {summary.operations_per_replica}"


def soft_placement_on_cuda():
    x_cpu = torch.linspace(-2, 2, 100).view(10, 10)  # 10 x 10 float32: 400 B each way
    x = x_cpu.cuda()
    try:
        cube(x)
        raise AssertionError("a CPU-only op ran on CUDA tensors without soft placement")
    except NotImplementedError as error:
        translated = as_placement_error(error)
        expect(
            translated is not None and "placement_check::cube has no kernel for CUDA" in str(translated),
            f"translation of torch's error: {translated}",
        )
    try:
        with sg.log_placement():
            cube(x)
        raise AssertionError("no PlacementError inside a log")
    except sg.PlacementError as error:
        expect("no kernel for cuda:0" in str(error) and "sg.soft_placement()" in str(error), str(error))

    w = x.clone().requires_grad_()
    with sg.soft_placement() as soft, sg.log_placement() as log:
        y = cube(w)
        y.sum().backward()
    torch.cuda.synchronize()
    expect(y.device == x.device, f"output on {y.device}")
    torch.testing.assert_close(y.detach().cpu(), x_cpu**3)
    torch.testing.assert_close(w.grad.cpu(), 3 * x_cpu**2)
    expect(
        soft.operations == {("placement_check::cube", "cuda:0"): 1, ("placement_check::square", "cuda:0"): 1},
        f"soft-placed: {soft.operations}",
    )
    summary = log.summary()
    print(summary, flush=True)
    soft_copies = {(c.source, c.destination): (c.count, c.num_bytes) for c in summary.copies if c.reason}
    # cube: x there (400 B) and back (400 B); square in backward: x there (400 B) and back (400 B).
    expect(soft_copies == {("cuda:0", "cpu"): (2, 800), ("cpu", "cuda:0"): (2, 800)}, f"soft copies {soft_copies}")
    return f"{soft.count()} ops soft-placed, values and gradient equal the CPU's"


def soft_placement_in_mirrored():
    strategy = sg.MirroredStrategy(["cuda:0", "cpu:0"])
    batch = torch.linspace(-1, 1, 10).view(5, 2)
    (piece,) = strategy.distribute_dataset([(batch,)])
    try:
        with sg.soft_placement() as soft, sg.log_placement() as log:
            results = strategy.run(lambda x: cube(x).sum().cpu(), args=piece)
    finally:
        strategy.close()
    got = [r.item() for r in strategy.experimental_local_results(results)]
    want = [(batch[:3] ** 3).sum().item(), (batch[3:] ** 3).sum().item()]
    expect(all(abs(a - b) < 1e-5 for a, b in zip(got, want)), f"results {got}, want {want}")
    # Replica 0 (cuda:0) has no kernel and soft-places; replica 1 (the CPU) runs it natively.
    expect(
        soft.count() == 1 and log.count(op="placement_check::cube", device="cpu", replica=1) == 1,
        f"soft {soft.operations}, replica 1 cube on cpu {log.count(op='placement_check::cube', replica=1)}",
    )
    return f"results {got}"


def log_overhead():
    """Not a pass/fail: how much the log costs per step on the GPU (ratio, one run)."""
    strategy = sg.OneDeviceStrategy("cuda:0")
    base = net()
    model, optimizer = strategy.distribute(base, torch.optim.SGD(base.parameters(), lr=0.1))
    x, y = torch.randn(256, 32, device="cuda"), torch.randint(0, 10, (256,), device="cuda")

    def step():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def timed(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            strategy.run(step)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / n

    timed(20)
    plain = timed(200)
    with sg.log_placement():
        timed(20)
        logged = timed(200)
    return f"step {plain * 1e3:.3f} ms without a log, {logged * 1e3:.3f} ms with one ({logged / plain:.1f}x)"


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU visible: nothing to check here (run `stratagem doctor` to see why)")
        return 1
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}", flush=True)
    CHECKS.run("placement log, OneDevice on cuda:0: copies, autograd thread, CPU op in a GPU replica", one_device_log)
    CHECKS.run("placement log, Mirrored over cuda:0 + cpu:0: replica threads", mirrored_gpu_and_cpu_log)
    CHECKS.run(
        "soft placement of a CPU-only op on CUDA tensors: error, values, gradient, copies", soft_placement_on_cuda
    )
    CHECKS.run("soft placement in Mirrored replica threads (cuda:0 + cpu:0)", soft_placement_in_mirrored)
    CHECKS.run("cost of the placement log per step (informative)", log_overhead)
    return CHECKS.summary("placement")


if __name__ == "__main__":
    sys.exit(main())
