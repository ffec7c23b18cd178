"""What the sharded tests' ranks run: plain PyTorch on one device as the reference, and the sharded core
(`strategies/sharded/`) on sub-meshes of 1, 2 and 3 ranks of one spawn, so one start-up checks every N."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

GLOBAL_BATCH = 13  # 7+6 over 2 ranks, 5+4+4 over 3: uneven splits, where FSDP2's AVG is off
STEPS = 5

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}


# Every optimizer in float64 at each N; float32 and accumulation over 2 micro-batches where the split is uneven
# (few cases: each costs a dozen collectives per step on a loaded machine).
CASES: dict[int, list[tuple[torch.dtype, str, int]]] = {
    n: [(torch.float64, name, 1) for name in OPTIMIZERS]
    + ([(torch.float32, "adamw", 1), (torch.float64, "adamw", 2)] if n > 1 else [])
    for n in (1, 2, 3)
}


def mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    # 17 and 7 rows do not divide by 2 or 3: FSDP2's padded shards are exercised too.
    return nn.Sequential(nn.Linear(6, 17), nn.Tanh(), nn.Linear(17, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)


def batches(dtype: torch.dtype, sizes: list[int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    sizes = sizes or [GLOBAL_BATCH] * STEPS
    return [(torch.randn(n, 6, generator=g, dtype=dtype), torch.randn(n, 3, generator=g, dtype=dtype)) for n in sizes]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def clipped_step(model: nn.Module, opt: Any) -> Any:
    """The step every sharded MLP case runs: the loss, backward, the gradient norm clipped to 0.5, the update."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def train_one_device(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    clip: float,
    accumulate: int,
) -> list[float]:
    """Plain PyTorch: the reference every sharded run must match. Returns the gradient norm of each update."""
    norms = []
    for i, (x, y) in enumerate(data):
        loss_fn(model, x, y).backward()
        if (i + 1) % accumulate == 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            opt.zero_grad()
    return norms


def world_group(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def exactness(rank: int, port: int) -> dict[str, Any]:
    """Every (N, optimizer, dtype, accumulation) case on this rank: the worst relative error against one device
    and the largest difference of the clipped gradient norm, per case (only ranks < N take part in a case)."""
    from torch.distributed.device_mesh import DeviceMesh

    from stratagem.data.split import split_sizes
    from stratagem.strategies.sharded.units import apply_cut, cut_model
    from stratagem.strategies.sharded.weighting import weigh_gradients
    from stratagem.strategies.state_memory import measured_local_bytes

    world_group(rank, 3, port)
    groups = {n: dist.new_group(list(range(n))) for n in (1, 2, 3)}
    out: dict[str, Any] = {}
    for n, group in groups.items():
        if rank >= n:
            continue
        mesh = DeviceMesh.from_group(group, "cpu")
        for dtype, name, accumulate in CASES[n]:
            make_opt = OPTIMIZERS[name]
            data = batches(dtype)
            reference = mlp(dtype)
            ref_norms = train_one_device(reference, make_opt(reference.parameters()), data, 0.5, accumulate)
            model = mlp(dtype)
            apply_cut(model, cut_model(model, None), mesh=mesh)
            comm = weigh_gradients([m for m in model.modules() if hasattr(m, "set_custom_reduce_scatter")])
            opt = make_opt(model.parameters())
            norms = []
            for i, (x, y) in enumerate(data):
                sizes = split_sizes(x.shape[0], n)
                start = sum(sizes[:rank])
                comm.weight = sizes[rank] / x.shape[0]
                last = (i + 1) % accumulate == 0
                model.set_requires_gradient_sync(last)
                loss_fn(model, x[start : start + sizes[rank]], y[start : start + sizes[rank]]).backward()
                if last:
                    norms.append(float(full(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))))
                    opt.step()
                    held = measured_local_bytes(model.parameters(), opt)  # gradients still held, as at a step's end
                    opt.zero_grad()
            worst = max(
                float((full(p).detach() - q.detach()).abs().max() / q.detach().abs().max())
                for p, q in zip(model.parameters(), reference.parameters())
            )
            norm_diff = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
            out[f"N={n} {name} {str(dtype)[6:]} accumulate={accumulate}"] = (worst, norm_diff)
            if accumulate == 1:
                out[f"memory N={n} {name} {str(dtype)[6:]}"] = memory_against_plan(rank, n, dtype, held, make_opt)
    out["fsdp2 AVG alone, N=2"] = fsdp_average(rank, groups[2]) if rank < 2 else None
    dist.barrier()
    dist.destroy_process_group()
    return out


def memory_against_plan(
    rank: int, n: int, dtype: torch.dtype, measured: dict[str, int], make_opt: Callable[[Any], torch.optim.Optimizer]
) -> dict[str, tuple[int, int]]:
    """(planned, measured) bytes of this rank's shards per category, the plan made from the unsharded model."""
    from stratagem.strategies.sharded.memory import plan_memory

    original = mlp(dtype)
    plan = plan_memory(
        list(original.parameters()),
        make_opt(original.parameters()),
        rank=rank,
        world_size=n,
        stage=3,
        largest_unit_bytes=0,
    )
    return {key: (getattr(plan, key), value) for key, value in measured.items()}


def fsdp_average(rank: int, group: Any) -> float:
    """FSDP2 as it comes (AVG of per-rank means) on 13 examples over 2 ranks: the error the weighting removes."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    x, y = batches(torch.float64)[0]
    reference = mlp(torch.float64)
    loss_fn(reference, x, y).backward()
    model = fully_shard(copy.deepcopy(mlp(torch.float64)), mesh=DeviceMesh.from_group(group, "cpu"))
    start, stop = (0, 7) if rank == 0 else (7, 13)
    loss_fn(model, x[start:stop], y[start:stop]).backward()
    return max(
        float((full(p.grad) - q.grad).abs().max() / q.grad.abs().max())
        for p, q in zip(model.parameters(), reference.parameters())
    )


# ---- the strategy itself, as a user's script drives it --------------------------------------------------
def cluster_of(rank: int, ports: tuple[int, int]) -> dict[str, Any]:
    """Two workers on free ports (each strategy of a test its own pair: a closed store's port may linger)."""
    return {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": rank}}


def gpt2_batches() -> list[dict[str, torch.Tensor]]:
    """Global batches of 13 sequences with -100 padding of varying length: ranks hold different token counts."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(3):
        ids = torch.randint(1, 48, (GLOBAL_BATCH, 8), generator=g)
        labels = ids.clone()
        lengths = torch.randint(2, 9, (GLOBAL_BATCH,), generator=g)
        labels[torch.arange(8)[None, :] >= lengths[:, None]] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def strategy_cases(rank: int, ports: list[tuple[int, int]]) -> dict[str, Any]:
    """ShardedStrategy under each stage on the MLP (AdamW), and tiny GPT-2 with tied embeddings and declared
    token counts, against one device; plus what the strategy reports and refuses."""
    import stratagem as sg

    out: dict[str, Any] = {}
    for stage in (3, 2):
        strategy = sg.ShardedStrategy(stage=stage, cluster=cluster_of(rank, ports[stage - 2]), timeout=60)
        try:
            out.update(_mlp_case(strategy, stage))
        finally:
            strategy.close()
    strategy = sg.ShardedStrategy(cluster=cluster_of(rank, ports[2]), timeout=60)
    try:
        out.update(_gpt2_case(strategy))
    finally:
        strategy.close()
    return out


def _mlp_case(strategy: Any, stage: int) -> dict[str, Any]:
    import tempfile

    import stratagem as sg

    out: dict[str, Any] = {}
    data = batches(torch.float32)
    with pytest_refusal() as refused:
        net = mlp(torch.float32)
        strategy.distribute(net, torch.optim.LBFGS(net.parameters()))
    out[f"stage {stage} LBFGS"] = refused.message
    reference = mlp(torch.float32)
    train_one_device(reference, OPTIMIZERS["adamw"](reference.parameters()), data, 0.5, 1)
    user_model = mlp(torch.float32)
    user_opt = OPTIMIZERS["adamw"](user_model.parameters())
    if stage == 3:
        out.update(_activations_measured(strategy, user_model, user_opt, data[0][0]))
    model, opt = strategy.distribute(user_model, user_opt)
    del user_opt
    plan = strategy.memory_plan()
    if stage == 3:
        out.update(_activations_after_distribute(strategy, model, data[0][0]))
    step = clipped_step(model, opt)

    for x, y in strategy.distribute_dataset(data):
        strategy.reduce("mean", strategy.run(step, args=(x, y)))
    out[f"stage {stage} mlp"] = max(
        float((full(p).detach() - q.detach()).abs().max() / q.detach().abs().max())
        for p, q in zip(model.parameters(), reference.parameters())
    )
    # Sharded in place, as fully_shard does: the user's module is the one trained, every parameter a shard.
    out[f"stage {stage} user model sharded in place"] = model.module is user_model and all(
        hasattr(p, "full_tensor") for p in user_model.parameters()
    )
    out[f"stage {stage} plan"] = (plan.parameters, plan.gathered_peak)
    out[f"stage {stage} explain"] = str(strategy.explain())
    gathered = strategy.step(lambda x: model(x).detach(), returns="gather")(data[0][0])
    out[f"stage {stage} gather"] = tuple(gathered.shape)
    if stage == 2:
        with tempfile.TemporaryDirectory() as backup_dir:
            callbacks = [sg.callbacks.BackupAndRestore(backup_dir, save_freq=1, delete_checkpoint=False)]
            sg.fit(strategy, model, opt, torch.nn.functional.mse_loss, data, callbacks=callbacks)
            out["backups"] = sorted(os.listdir(backup_dir))
    return out


def _activations_measured(strategy: Any, net: nn.Module, opt: Any, x: torch.Tensor) -> dict[str, Any]:
    """The plan's activations measured from a global batch of 13: this rank's part, rows 0-6 or 7-12."""
    from stratagem.strategies.activation_memory import measure_activations

    rank = strategy.cluster.task_index
    plan = strategy.memory_plan(net, opt, example_inputs=x)
    part = x[:7] if rank == 0 else x[7:]
    out: dict[str, Any] = {
        "activations": (plan.activations, measure_activations(net, part).peak, plan.activations_how),
    }
    with pytest_refusal() as refused:
        strategy.memory_plan(net, opt, example_inputs=x, activations=1)
    out["activations both"] = refused.message
    return out


def _activations_after_distribute(strategy: Any, model: Any, x: torch.Tensor) -> dict[str, Any]:
    """distribute's plan keeps the measured activations; a sharded model is not measured; given bytes replace them."""
    out: dict[str, Any] = {"activations kept": strategy.memory_plan().activations}
    with pytest_refusal() as refused:
        strategy.memory_plan(model.module, example_inputs=x)
    out["activations sharded"] = refused.message
    with pytest_refusal() as refused:
        strategy.memory_plan(activations=-1)
    out["activations negative"] = refused.message
    given = strategy.memory_plan(activations=2**30)
    at_rest = given.parameters + (given.optimizer_state or 0) + given.transport + given.gathered_with_activations
    out["activations given"] = (given.activations, given.activations_how, given.total - at_rest)
    return out


def _gpt2_case(strategy: Any) -> dict[str, Any]:
    import warnings

    from zoo import tiny_gpt2

    import stratagem as sg

    out: dict[str, Any] = {}
    torch.manual_seed(0)
    # float64 parameters (transformers computes the loss in float32 whatever the dtype) and SGD with momentum:
    # Adam's first steps turn float32 rounding of near-zero gradients into whole steps of lr, hiding the weighting.
    user_model = tiny_gpt2().to(torch.float64)
    reference = copy.deepcopy(user_model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    gpt = gpt2_batches()
    for batch in gpt:
        reference(**batch).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = strategy.distribute(user_model, torch.optim.SGD(user_model.parameters(), lr=0.1, momentum=0.9))
    out["gpt2 warnings"] = [str(w.message) for w in caught if "ShardedStrategy" in str(w.message)]

    def lm_step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        output = model(**batch)
        sg.set_loss_weight((batch["labels"][:, 1:] != -100).sum())
        output.loss.backward()
        opt.step()
        opt.zero_grad()
        return output.loss.detach()

    for batch in strategy.distribute_dataset(gpt):
        strategy.run(lm_step, args=(batch,))
    expected = dict(reference.named_parameters())
    out["gpt2"] = max(
        float((full(p).detach() - expected[name].detach()).abs().max() / expected[name].detach().abs().max())
        for name, p in model.named_parameters()
    )
    return out


class _Refusal:
    message: str = ""


class pytest_refusal:
    """Records the message of the InputError the block raises (fails if it raises none)."""

    def __enter__(self) -> _Refusal:
        self.refusal = _Refusal()
        return self.refusal

    def __exit__(self, kind: Any, error: Any, tb: Any) -> bool:
        from stratagem.errors import InputError

        if not isinstance(error, InputError):
            raise AssertionError(f"expected an InputError, got {error!r}")
        self.refusal.message = str(error)
        return True
