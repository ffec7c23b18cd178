"""What the tests of sg.fit under TensorParallelStrategy run on each rank (tests/test_tensor_parallel_fit.py):

- `fit_across_techniques`: the tiny GPT-2 of tensor_parallel_cases trained by sg.fit with BackupAndRestore under
  TensorParallelStrategy, resumed from its backup under ShardedStrategy, and from that one under
  TensorParallelStrategy again; every parameter whole after each run, against one device (`fit_one_device`);
- `on_two_workers`: a backward outside strategy.run refused with the fix; fit with accumulate_steps against one
  device (`fit_one_device_accumulated`); no_sync on a data axis refused; a memory plan over a cgroup v1 limit
  refused in distribute with the figures and a mesh that fits.
Whole values come back as numpy arrays."""

from __future__ import annotations

import os
import signal
from typing import Any

import tensor_parallel_cases as cases
import torch
import torch.nn.functional as F
from sharded_limit_cases import _read_int, _write
from torch import nn

FIT_EXAMPLES, FIT_BATCH, FIT_SEED, FIT_EPOCHS = 39, 13, 5, 2  # 3 steps an epoch: backups mid-epoch


def fit_data() -> tuple[torch.Tensor, torch.Tensor]:
    """39 sequences of 8 ids and their labels, -100 past a length that varies (fit batches them: ShuffledBatches)."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, cases.VOCAB, (FIT_EXAMPLES, 8), generator=g)
    labels = ids.clone()
    lengths = torch.randint(2, 9, (FIT_EXAMPLES,), generator=g)
    labels[torch.arange(8)[None, :] >= lengths[:, None]] = -100
    return ids, labels


def fit_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean over the tokens with a label, weighted by their count across replicas (one device's mean)."""
    import stratagem as sg

    sg.set_loss_weight((labels[:, 1:] != -100).sum())
    return cases.lm_loss(logits, labels)


def fit_one_device(steps: int | None = None) -> dict[str, torch.Tensor]:
    """The whole run on one device in plain PyTorch, in ShuffledBatches' documented order (epoch e: randperm(n) of
    a generator seeded seed * 1_000_003 + e + 1), clipped to 0.5 as fit's clip_grad_norm."""
    model = cases.gpt2()
    optimizer = cases.optimizer(model.parameters())
    ids, labels = fit_data()
    done = 0
    for epoch in range(FIT_EPOCHS):
        order = torch.randperm(FIT_EXAMPLES, generator=torch.Generator().manual_seed(FIT_SEED * 1_000_003 + epoch + 1))
        for idx in order.split(FIT_BATCH):
            if done == steps:
                break
            done += 1
            cases.lm_loss(model(input_ids=ids[idx]).logits, labels[idx]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _fit_under(strategy: Any, directory: str, stop_after: int | None, resumes: bool) -> dict[str, Any]:
    """sg.fit of the tiny GPT-2 under `strategy`, backed up after every step into `directory` (kept), stopped after
    step `stop_after` (None: to the end); what it resumed from, and every parameter whole. `resumes`: the model is
    built with other values than the backup's, so that a resume which loaded nothing is seen."""
    import stratagem as sg
    from stratagem.strategies.tensor_parallel.apply import whole_tensor

    class StopAfter(sg.callbacks.Callback):
        def on_train_batch_end(self, context: Any, num_examples: int) -> None:
            context.stop_training = context.step == stop_after

    user = cases.gpt2()
    with torch.no_grad():
        for p in user.parameters():
            p.add_(1.0 if resumes else 0.0)
    backup = sg.callbacks.BackupAndRestore(directory, save_freq=1, delete_checkpoint=False)
    history = sg.fit(
        strategy, user, cases.optimizer(user.parameters()), fit_loss, fit_data(), batch_size=FIT_BATCH,
        seed=FIT_SEED, epochs=FIT_EPOCHS, clip_grad_norm=0.5, callbacks=[backup, StopAfter()],
    )  # fmt: skip
    whole = {name: whole_tensor(p).detach().numpy().copy() for name, p in history.model.named_parameters()}
    left_on = history.trace  # fit's default: summary mode on a sample of the steps, this worker's table
    trace = None
    if left_on is not None:
        rows = left_on.summary.rows
        trace = {"num_steps": left_on.num_steps, "num_recorded": left_on.num_recorded, "tasks": [r.task for r in rows],
                 "adds_up": all(abs(r.parts_ms - r.step_ms) <= 0.02 * r.step_ms for r in rows)}  # fmt: skip
    return {
        "restored from": backup.restored_from, "whole": whole, "memory plan": strategy.memory_plan().total,
        "trace": trace,
    }  # fmt: skip


def fit_across_techniques(rank: int, ports: list[list[int]], directory: str) -> dict[str, Any]:
    """sg.fit under TensorParallelStrategy (2 model workers) stopped after step 4 (mid-epoch 2), resumed from its
    backup under ShardedStrategy and stopped after step 5, resumed from that one under TensorParallelStrategy to the
    end (step 6): every step backed up by BackupAndRestore, one directory throughout."""
    import stratagem as sg

    out = {}
    mesh = sg.DeviceMesh((2,), ("model",))
    for name, stop_after, make in (
        ("tensor parallel", 4, lambda c: sg.TensorParallelStrategy(cases.layout_map(mesh), cluster=c, timeout=120)),
        ("sharded", 5, lambda c: sg.ShardedStrategy(cluster=c, timeout=120)),
        ("tensor parallel again", None, lambda c: sg.TensorParallelStrategy(cases.layout_map(mesh), cluster=c, timeout=120)),
    ):  # fmt: skip
        strategy = make(cases.cluster_of(rank, ports[len(out)]))
        try:
            out[name] = _fit_under(strategy, directory, stop_after, resumes=bool(out))
        finally:
            strategy.close()
    return out


def _stop_one_worker(rank: int, ports: list[int], backup_dir: str) -> Any:
    """fit on 2 model workers where SIGTERM reaches worker 1 alone, after step 2: (exit code, step) of its stop."""
    import stratagem as sg

    class SignalWorkerOne(sg.callbacks.Callback):
        def on_train_batch_end(self, context: Any, num_examples: int) -> None:
            if rank == 1 and context.step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    mesh = sg.DeviceMesh((2,), ("model",))
    strategy = sg.TensorParallelStrategy(mlp_layouts(mesh), cluster=cases.cluster_of(rank, ports), timeout=60)
    try:
        user = mlp(8, 2)
        g = torch.Generator().manual_seed(0)
        x, y = (
            torch.randn(40, 8, generator=g, dtype=torch.float64),
            torch.randn(40, 8, generator=g, dtype=torch.float64),
        )
        backup = sg.callbacks.BackupAndRestore(backup_dir, save_freq=100, grace_period=20)
        sg.fit(
            strategy, user, torch.optim.SGD(user.parameters(), lr=0.1), F.mse_loss, (x, y), batch_size=4,
            callbacks=[backup, SignalWorkerOne()],
        )  # fmt: skip
        return "trained to the end"
    except sg.Preempted as stopped:
        return [stopped.code, stopped.step]
    finally:
        strategy.close()


# ---- what is refused, with the fix ---------------------------------------------------------------------------------
LIMIT_WIDTH, LIMIT_DEPTH = 512, 16  # 32 MiB of float64 parameters in pieces of 2 MiB
LIMIT_BUDGET = 24 << 20  # over the process's usage: under the plan at 2 model workers (66 MiB, 34 beyond the model)


def mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).to(torch.float64)


def mlp_layouts(mesh: Any) -> Any:
    """Megatron's pairs: even layers split along their output features, odd ones along their input features."""
    import stratagem as sg

    layouts = sg.LayoutMap(mesh)
    layouts[r"^\d*[02468]\.weight$"] = ("model", None)
    layouts[r"^\d*[02468]\.bias$"] = ("model",)
    layouts[r"^\d*[13579]\.weight$"] = (None, "model")
    return layouts


def fit_one_device_accumulated(k: int) -> dict[str, torch.Tensor]:
    """`fit_one_device` with one update per `k` batches: each batch's mean loss weighted by its share of the group's
    examples (fit's accumulate_steps), the last group of an epoch shorter."""
    model = cases.gpt2()
    optimizer = cases.optimizer(model.parameters())
    ids, labels = fit_data()
    for epoch in range(FIT_EPOCHS):
        order = torch.randperm(FIT_EXAMPLES, generator=torch.Generator().manual_seed(FIT_SEED * 1_000_003 + epoch + 1))
        parts = list(order.split(FIT_BATCH))
        for first in range(0, len(parts), k):
            group = parts[first : first + k]
            for idx in group:
                share = len(idx) / sum(len(p) for p in group)
                (cases.lm_loss(model(input_ids=ids[idx]).logits, labels[idx]) * share).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def on_two_workers(rank: int, ports: list[list[int]], backup_dir: str, directories: list[str] | None) -> dict[str, Any]:
    """On 2 workers, one strategy after the other: a backward outside strategy.run (refused); fit with
    accumulate_steps=2 on 2 model workers (every parameter whole after it); no_sync on a (data 2, model 1) mesh
    (refused); fit with BackupAndRestore into `backup_dir` where worker 1 alone receives SIGTERM after step 2 (how
    each stopped); then, with `directories`, this process in its own cgroup v1 limited to LIMIT_BUDGET over its
    usage, and distribute of a plan over it (refused)."""
    import stratagem as sg
    from stratagem.strategies.tensor_parallel.apply import whole_tensor

    out: dict[str, Any] = {}
    mesh = sg.DeviceMesh((2,), ("model",))
    strategy = sg.TensorParallelStrategy(mlp_layouts(mesh), cluster=cases.cluster_of(rank, ports[0]), timeout=120)
    try:
        model = strategy.distribute(mlp(8, 2))
        x, y = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
        loss = F.mse_loss(model(x), y)  # the forward runs anywhere
        try:
            loss.backward()  # outside strategy.run
            out["backward outside run"] = "ran"
        except sg.InputError as error:
            out["backward outside run"] = str(error)
        out["no gradient"] = all(p.grad is None for p in model.parameters())
    finally:
        strategy.close()
    strategy = sg.TensorParallelStrategy(cases.layout_map(mesh), cluster=cases.cluster_of(rank, ports[1]), timeout=120)
    try:
        user = cases.gpt2()
        history = sg.fit(
            strategy, user, cases.optimizer(user.parameters()), fit_loss, fit_data(), batch_size=FIT_BATCH,
            seed=FIT_SEED, epochs=FIT_EPOCHS, clip_grad_norm=0.5, accumulate_steps=2, trace=False,
        )  # fmt: skip
        out["accumulated"] = {n: whole_tensor(p).detach().numpy().copy() for n, p in history.model.named_parameters()}
        out["accumulated trace"] = history.trace
    finally:
        strategy.close()
    data_mesh = sg.DeviceMesh((2, 1), ("data", "model"))
    strategy = sg.TensorParallelStrategy(sg.LayoutMap(data_mesh), cluster=cases.cluster_of(rank, ports[2]), timeout=120)
    try:
        with strategy.no_sync():
            out["no_sync on a data axis"] = "entered"
    except sg.InputError as error:
        out["no_sync on a data axis"] = str(error)
    finally:
        strategy.close()
    out["stopped"] = _stop_one_worker(rank, ports[4], backup_dir)
    if directories is None:
        return out
    user = mlp(LIMIT_WIDTH, LIMIT_DEPTH)  # built before the limit: the user's model as it stands before distribute
    strategy = sg.TensorParallelStrategy(mlp_layouts(mesh), cluster=cases.cluster_of(rank, ports[3]), timeout=120)
    try:
        directory = directories[rank]
        try:  # the memory held moves with the process where the kernel still can (removed in Linux 6.x)
            _write(f"{directory}/memory.move_charge_at_immigrate", "3")
        except OSError:
            pass
        _write(f"{directory}/cgroup.procs", str(os.getpid()))
        out["limit"] = _read_int(f"{directory}/memory.usage_in_bytes") + LIMIT_BUDGET
        _write(f"{directory}/memory.limit_in_bytes", str(out["limit"]))
        try:
            strategy.distribute(user, torch.optim.AdamW(user.parameters()))
            out["over the limit"] = "distributed"
        except sg.InputError as error:
            out["over the limit"] = str(error)
        out["split"] = any(hasattr(p, "to_local") for p in user.parameters())
    finally:
        strategy.close()
    return out


def fit_zero3_2d(rank: int, ports: list[int], directory: str) -> dict[str, Any]:
    """sg.fit on the 2 x 2 (data, model) mesh with weights also sharded along `data` (ZeRO-3), stopped after step 4
    (mid-epoch 2), every step backed up."""
    import stratagem as sg

    layouts = cases.layout_map(sg.DeviceMesh((2, 2), ("data", "model")), data_sharded=True)
    strategy = sg.TensorParallelStrategy(layouts, cluster=cases.cluster_of(rank, ports), timeout=120)
    try:
        return _fit_under(strategy, directory, 4, resumes=False)
    finally:
        strategy.close()


def fit_resumed_1d(rank: int, ports: list[int], directory: str) -> dict[str, Any]:
    """sg.fit resumed from `fit_zero3_2d`'s backup on 2 model workers (one `model` axis), to the end."""
    import stratagem as sg

    layouts = cases.layout_map(sg.DeviceMesh((2,), ("model",)))
    strategy = sg.TensorParallelStrategy(layouts, cluster=cases.cluster_of(rank, ports), timeout=120)
    try:
        return _fit_under(strategy, directory, None, resumes=True)
    finally:
        strategy.close()
