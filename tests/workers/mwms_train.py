"""One worker of a multi-worker equivalence or fault test, run by the tests under `stratagem launch`
or as plain subprocesses with a TF_CONFIG. Settings arrive as environment variables:

MW_MODEL, MW_OPT, MW_DTYPE     which case of tests/cases.py to train
MW_OUT                         where the chief saves the final state (torch.save)
MW_LOCAL                       local replicas per worker (logical CPU devices)
MW_TIMEOUT                     the strategy's timeout in seconds
MW_KILL_RANK, MW_KILL_STEP     this rank SIGKILLs itself at the start of that step
MW_WIDE_RANK                   this rank builds a model with a different shape
MW_SHORT_RANK                  this rank's loader yields one batch less (shard="data")
MW_IN_PLACE                    1: zero_grad(set_to_none=False) and two backward passes of half the loss
                               per step, so gradients accumulate in place (in the buckets' views)
MW_SHM                         the strategy's shared_memory: 0 (Gloo), 1 (shared memory), unset (its choice)
MW_MAP_CAP_RANK                this rank maps the shared-memory file under a real address-space cap
                               (RLIMIT_AS at its current size, as `ulimit -v` would), so the kernel refuses the map
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from cases import build, make_batches  # noqa: E402
from torch import nn  # noqa: E402

import stratagem as sg  # noqa: E402
from stratagem.devices import DeviceRegistry  # noqa: E402


def cap_address_space_while_mapping() -> None:
    """Every shared-memory map of this process runs under RLIMIT_AS set to the address space it already
    has, so the kernel refuses it with ENOMEM, as under `ulimit -v`; the cap is lifted afterwards, so only
    the map itself meets it (Gloo's threads and the training's allocations do not)."""
    import resource

    from stratagem.shm import files

    real = files.open_mapped

    def capped(*args, **kwargs):
        with open("/proc/self/status") as f:
            size_kib = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
        before = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (size_kib * 1024, before[1]))
        try:
            return real(*args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_AS, before)

    files.open_mapped = capped


def main() -> int:
    torch.set_num_threads(1)
    env = os.environ
    if env.get("MW_MAP_CAP_RANK") is not None:
        task = json.loads(env["TF_CONFIG"])["task"]
        if str(task["index"]) == env["MW_MAP_CAP_RANK"]:
            cap_address_space_while_mapping()
    dtype = {"f64": torch.float64, "f32": torch.float32}[env.get("MW_DTYPE", "f64")]
    local = int(env.get("MW_LOCAL", "1"))
    registry = DeviceRegistry()
    registry.set_logical_device_configuration("cpu", max(local, 2))
    shared_memory = {"0": False, "1": True}.get(env.get("MW_SHM", ""))
    strategy = sg.MultiWorkerMirroredStrategy(
        [f"cpu:{i}" for i in range(local)],
        timeout=float(env.get("MW_TIMEOUT", "60")),
        registry=registry,
        shared_memory=shared_memory,
    )
    rank = strategy.cluster.rank
    model, opt, shape = build(env.get("MW_MODEL", "mlp"), env.get("MW_OPT", "sgd_momentum"), dtype)
    if env.get("MW_WIDE_RANK") == str(rank):
        model[2] = nn.Linear(16, 17).to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank != 0:
        # Only the chief's initial parameters count: they are broadcast to every worker.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    model, opt = strategy.distribute(model, opt)
    batches = make_batches(shape, dtype)
    if env.get("MW_SHORT_RANK") == str(rank):
        batches = batches[:-1]

    in_place = env.get("MW_IN_PLACE") == "1"

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        if in_place:
            (loss * 0.5).backward(retain_graph=True)
            (loss * 0.5).backward()
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=not in_place)
        return loss

    if env.get("MW_FILES"):
        files = sorted(str(p) for p in Path(env["MW_FILES"]).glob("*.pt"))
        batches = sg.data.FileDataset(files, torch.load, batch_size=6)
    dataset = strategy.distribute_dataset(batches)
    losses = []
    for i, (x, y) in enumerate(dataset):
        if env.get("MW_KILL_RANK") == str(rank) and env.get("MW_KILL_STEP") == str(i):
            os.kill(os.getpid(), signal.SIGKILL)
        losses.append(float(strategy.reduce("mean", strategy.run(step, args=(x, y)))))
    if rank == 0 and env.get("MW_OUT"):
        torch.save(
            {
                "state": model.state_dict(),
                "losses": losses,
                "steps": dataset.steps,
                "unused": dataset.unused_examples,
                "explain": str(strategy.explain()),
            },
            env["MW_OUT"],
        )
    sums = [line.strip() for line in str(strategy.explain()).splitlines() if "cross-worker sums" in line]
    print(f"rank {rank} done: {len(losses)} steps, unused {dataset.unused_examples}; {sums}", flush=True)
    strategy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
