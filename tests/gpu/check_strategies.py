"""GPU check for the strategies: run on a machine with a CUDA GPU (a few minutes at most).

    python tests/gpu/check_strategies.py              # every check
    python tests/gpu/check_strategies.py central      # only the checks whose name holds a word given

Checks what a CPU-only machine cannot: training on cuda:0 equals a plain loop; MirroredStrategy
over every GPU (NCCL when there are two or more) and over cuda:0 + cpu:0 (reduction to one
device, replicas on different devices, gradient combination called from torch's GPU autograd
thread) equals one device; MultiWorkerMirroredStrategy over NCCL in one process; CentralStorageStrategy
with the parameters on the computing GPU, on the CPU (copied to the GPU every step) and over cuda:0 +
cpu:0 equals one device, its optimizer state on the central device; and the cost of
OneDevice and Mirrored against plain PyTorch on the MLP workload. Prints one line per check and
exits 1 if any failed.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import torch
import torch.nn.functional as F
from harness import Checks
from torch import nn

import stratagem as sg
from stratagem.bench.workloads import WORKLOADS

CHECKS = Checks()


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def batches(device="cpu"):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(n, 32, generator=g).to(device), torch.randint(0, 10, (n,), generator=g).to(device))
        for n in (64, 63, 5, 2)
    ]


def reference(device):
    model = net().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in batches(device):
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return {k: v.cpu() for k, v in model.state_dict().items()}


def train(strategy, kept=None):
    base = net()
    model, opt = strategy.distribute(base, torch.optim.Adam(base.parameters(), lr=1e-2))
    if kept is not None:
        kept.append(opt)  # for checks of where the optimizer state lives

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    for x, y in strategy.distribute_dataset(batches()):
        strategy.run(step, args=(x, y))
    torch.cuda.synchronize()
    return {k: v.cpu() for k, v in model.state_dict().items()}


def same(got, want, tol=1e-4):
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=tol, atol=tol)


def one_device():
    same(train(sg.OneDeviceStrategy("cuda:0")), reference("cuda:0"))
    return "OneDeviceStrategy('cuda:0') equals a plain loop on cuda:0"


def mirrored_all_gpus():
    strategy = sg.MirroredStrategy(require_gpu=True)
    text = str(strategy.explain())
    same(train(strategy), reference("cuda:0"))
    strategy.close()
    return f"{strategy.num_replicas_in_sync} GPU replica(s) equal one device\n{text}"


def mirrored_gpu_and_cpu():
    strategy = sg.MirroredStrategy(["cuda:0", "cpu:0"])
    text = str(strategy.explain())
    assert "reduce-to-one-device" in text, text
    same(train(strategy), reference("cuda:0"))
    strategy.close()
    return f"cuda:0 + cpu:0 equal one device\n{text}"


def multi_worker_nccl():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = {"cluster": {"worker": [f"127.0.0.1:{port}"]}, "task": {"type": "worker", "index": 0}}
    strategy = sg.MultiWorkerMirroredStrategy(["cuda:0"], cluster=cluster, timeout=60)
    text = str(strategy.explain())
    assert "nccl" in text, text
    same(train(strategy), reference("cuda:0"))
    strategy.close()
    return f"one NCCL worker equals one device\n{text}"


def model_parallel():
    """Stages on cuda:0 and the CPU (and on two GPUs when there are): real device boundaries both ways."""
    lines = []
    splits = [["cuda:0", "cpu:0"], ["cpu:0", "cuda:0"]] + (
        [["cuda:0", "cuda:1"]] if torch.cuda.device_count() > 1 else []
    )
    for stages in splits:
        strategy = sg.ModelParallelStrategy(stages, num_micro_batches=3)
        same(train(strategy), reference("cuda:0"))
        for info in strategy.stage_map():
            devices = {str(p.device) for p in info.parameters}
            assert devices == {info.physical}, f"stage {info.stage} on {info.physical} holds parameters on {devices}"
        strategy.close()
        lines.append(f"stages {stages}, 3 micro-batches: equal to one device, each stage's parameters on its device")
    strategy = sg.ModelParallelStrategy(placement={"0": "cuda:0", "2": "cpu:0"})
    same(train(strategy), reference("cuda:0"))
    lines.append("placement {'0': 'cuda:0', '2': 'cpu:0'}: equal to one device")
    return "\n".join(lines) + f"\n{strategy.explain()}"


def central_storage():
    """Parameters on the GPU that computes; on the CPU, copied to the GPU every step; over cuda:0 + cpu:0
    (the CPU replica reads the central parameters in place, the GPU one gets copies); every GPU when several."""
    cases = [(["cuda:0"], None, "cuda:0"), (["cuda:0"], "cpu", "cpu"), (["cuda:0", "cpu:0"], None, "cpu")]
    if torch.cuda.device_count() > 1:
        cases.append((None, None, "cpu"))
    lines = []
    for devices, parameter_device, home in cases:
        strategy = sg.CentralStorageStrategy(devices, parameter_device=parameter_device)
        kept = []
        same(train(strategy, kept), reference("cuda:0"))
        state = kept[0].state
        tensors = [t for entry in state.values() for t in entry.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
        assert len(state) == 4 and tensors, f"expected one Adam state per parameter (4), got {len(state)}"
        assert all(t.device == torch.device(home) for t in tensors), (
            f"state on {sorted({str(t.device) for t in tensors})}"
        )
        text = str(strategy.explain())
        strategy.close()
        lines.append(
            f"devices={devices}, parameter_device={parameter_device}: equal to one device, "
            f"optimizer state once on {home}\n{text}"
        )
    return "\n".join(lines)


def throughput():
    workload = WORKLOADS["mlp"]
    data = [(x.cuda(), y.cuda()) for x, y in workload.make_batches()]

    def timed(step_fn, steps=300):
        for i in range(20):
            step_fn(i)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            step_fn(i)
        torch.cuda.synchronize()
        return steps * workload.global_batch / (time.perf_counter() - t0)

    model = workload.build_model().cuda()
    opt = workload.build_optimizer(model)

    def plain(i):
        x, y = data[i % 8]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    results = {"plain": timed(plain)}
    strategies = (
        ("one_device", sg.OneDeviceStrategy("cuda:0")),
        ("mirrored_all_gpus", sg.MirroredStrategy()),
        ("central_storage", sg.CentralStorageStrategy()),
        ("central_storage_parameters_on_cpu", sg.CentralStorageStrategy(["cuda:0"], parameter_device="cpu")),
    )
    for name, strategy in strategies:
        base = workload.build_model()
        m, o = strategy.distribute(base, workload.build_optimizer(base))
        dataset = list(strategy.distribute_dataset(workload.make_batches()))

        def train_step(x, y, m=m, o=o):
            o.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            return loss

        results[name] = timed(lambda i, s=strategy, d=dataset, f=train_step: s.run(f, args=d[i % 8]))
        strategy.close()
    return json.dumps(
        {k: round(v) for k, v in results.items()}
        | {f"{k}/plain": round(v / results["plain"], 3) for k, v in results.items() if k != "plain"}
    )


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU visible: nothing to check here (run `stratagem doctor` to see why)")
        return 1
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    CHECKS.only.extend(sys.argv[1:])
    print(
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): "
        f"{torch.cuda.get_device_name(0)}",
        flush=True,
    )
    CHECKS.run("one device on cuda:0", one_device)
    CHECKS.run("mirrored over every GPU", mirrored_all_gpus)
    CHECKS.run("mirrored over cuda:0 and cpu:0", mirrored_gpu_and_cpu)
    CHECKS.run("multi-worker over NCCL, one process", multi_worker_nccl)
    CHECKS.run("model parallel: stages and placement across cuda:0 and the CPU", model_parallel)
    CHECKS.run("central storage: parameters on the GPU, on the CPU, and over cuda:0 + cpu:0", central_storage)
    CHECKS.run("throughput on the MLP workload (samples/s)", throughput)
    return CHECKS.summary("strategy")


if __name__ == "__main__":
    sys.exit(main())
