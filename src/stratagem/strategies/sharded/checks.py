"""What ShardedStrategy refuses, each with the reason and the fix: before it builds anything (the stage, LBFGS, a
stepped optimizer, CUDA on Gloo), and once sharded, before the first step: a rank whose shards differ from the plan."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from stratagem.errors import InputError

STAGES = (2, 3)

# Optimizers whose step reads whole tensors (a line search over the flattened parameters), which a
# rank holding 1/N of every parameter cannot compute.
_WHOLE_TENSOR_OPTIMIZERS = (torch.optim.LBFGS,)


def check_stage(stage: object) -> int:
    """`stage` as 2 or 3, refused otherwise."""
    if isinstance(stage, bool) or stage not in STAGES:
        raise InputError(
            f"ShardedStrategy shards at stage 2 or 3. Received: stage={stage!r}. Use stage=3 (parameters gathered "
            "per unit for forward and again for backward) or stage=2 (kept gathered from forward to backward)."
        )
    return int(stage)  # type: ignore[call-overload]


def copy_refusal(world_size: int) -> str:
    """The error of `torch.save(model)`, pickling or `copy.deepcopy(model)` of the model `distribute` handed back,
    whose pickle would hold this rank's shards only (FSDP2 refuses it with an error that names neither)."""
    return (
        "A ShardedStrategy model cannot be saved whole, pickled or deep-copied: each rank holds only its shard of every "
        f"parameter (1/{world_size}, FSDP2's DTensors), so a copy made on one rank is not the model. Received: "
        "torch.save, pickle or copy.deepcopy of the ShardedModel that distribute() handed back. To save it whole, call "
        "torch.distributed.checkpoint.state_dict.get_model_state_dict(model, options=StateDictOptions("
        "full_state_dict=True)) on every rank and torch.save the result on the chief; or export a backup with "
        "`stratagem checkpoint export`. For a copy to train (an EMA), distribute a copy of the model as built."
    )


def check_optimizer(optimizer: torch.optim.Optimizer | None) -> None:
    """Refuses an optimizer that needs whole tensors, or one that has already stepped (its state is not sharded)."""
    if optimizer is None:
        return
    if isinstance(optimizer, _WHOLE_TENSOR_OPTIMIZERS):
        raise InputError(
            f"{type(optimizer).__name__} needs every parameter whole at each step (its line search runs over the "
            "flattened parameters), but under ShardedStrategy each rank holds 1/N of each. "
            f"Received: {type(optimizer).__name__}. Use an element-wise optimizer (SGD, Adam, AdamW, Adagrad), "
            "or MultiWorkerMirroredStrategy for LBFGS."
        )
    if any(state for state in optimizer.state.values()):
        raise InputError(
            "ShardedStrategy builds the optimizer's state on the shards, so the optimizer must not have stepped "
            f"yet. Received: {type(optimizer).__name__} holding state for {len(optimizer.state)} parameter(s). "
            "Call distribute() before the first optimizer.step()."
        )


def check_device(placed: Iterable[tuple[str, torch.device]], backend: str) -> None:
    """Refuses CUDA parameters (name, device) on a Gloo group, rather than moving them to the CPU behind the
    user's back or failing inside the first backward's reduce-scatter."""
    cuda = [name for name, device in placed if device.type == "cuda"]
    if cuda and backend == "gloo":
        raise InputError(
            "ShardedStrategy's process group uses Gloo, which does not reduce-scatter CUDA tensors. "
            f"Received: CUDA parameters ({cuda[0]}, ...) on a Gloo group. Pass device='cuda' so the group uses "
            "NCCL, or keep the model on the CPU."
        )


ShardRecord = tuple[str, list[int], str, list[int]]
"""One parameter as a rank holds it: (name, whole shape, dtype, shape of this rank's shard)."""


def shard_records(named_parameters: Iterable[tuple[str, torch.Tensor]]) -> list[ShardRecord]:
    """This rank's records of its sharded parameters (a DTensor's local part, a plain tensor as it is)."""
    records = []
    for name, p in named_parameters:
        local = p.to_local() if hasattr(p, "to_local") else p
        records.append((name, list(p.shape), str(p.dtype).removeprefix("torch."), list(local.shape)))
    return records


def shard_mismatches(records: Sequence[Sequence[ShardRecord]], task_names: Sequence[str]) -> list[str]:
    """Where a rank's shards differ from the plan: rank 0's parameters cut into ceil-sized row chunks (memory.py),
    in the same names, shapes and dtypes on every rank. One line per rank and parameter, empty when all agree."""
    from stratagem.strategies.sharded.memory import shard_rows

    world_size = len(records)
    reference = [(name, shape, dtype) for name, shape, dtype, _ in records[0]]
    problems = []
    for rank, held in enumerate(records):
        who = f"{task_names[rank]} (rank {rank})"
        if [r[0] for r in held] != [r[0] for r in reference]:
            extra = sorted({r[0] for r in held} ^ {r[0] for r in reference})
            problems.append(f"{who} holds other parameters than rank 0 ({', '.join(extra[:3]) or 'another order'})")
            continue
        for (name, shape, dtype, local), (_, want_shape, want_dtype) in zip(held, reference):
            want = [shard_rows(want_shape[0], world_size, rank), *want_shape[1:]] if want_shape else list(local)
            if dtype != want_dtype or list(local) != want:
                problems.append(
                    f"{who}: '{name}' has a shard of {tuple(local)} {dtype} (whole {tuple(shape)}), "
                    f"the plan {tuple(want)} {want_dtype} (whole {tuple(want_shape)})"
                )
    return problems


def check_shards(records: Sequence[Sequence[ShardRecord]], task_names: Sequence[str]) -> None:
    """Refuses shards that differ from the plan on any rank (every rank gets the same records, so all refuse)."""
    problems = shard_mismatches(records, task_names)
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise InputError(
            "Every rank must shard the same model: the first step would all-gather shards of different sizes or "
            f"dtypes. Received: {shown}. Build the model with the same configuration and dtype on every rank "
            "(the same code, arguments and .to(dtype)) before distribute()."
        )


def check_another_model(model: nn.Module, *, running: bool, held: Mapping[int, weakref.ref[torch.Tensor]]) -> None:
    """Several models may be distributed (a GAN's two), each once, before or between steps, never inside one."""
    if running:
        raise InputError(
            "distribute() ran inside strategy.run(): every worker must shard a model at the same point, before "
            f"its first step. Received: distribute() of a {type(model).__name__} inside the step function. "
            "Distribute every model before the loop."
        )
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise InputError(
            "distribute() needs the plain model: this one is already sharded by FSDP2. Received: a "
            f"{type(model).__name__} holding FSDP2 modules (a distributed model's `.module`?). Pass the model "
            "as built, once."
        )
    shared = [name for name, p in model.named_parameters() if p is _alive(held.get(id(p)))]
    if shared:
        raise InputError(
            "A model shares parameters with a model this strategy already distributed, whose sharded copy would "
            f"then train them apart. Received: a {type(model).__name__} whose parameters {shared[:3]} were "
            "distributed before. Distribute each model once, or one module that holds both."
        )


def _alive(ref: weakref.ref[torch.Tensor] | None) -> torch.Tensor | None:
    return None if ref is None else ref()
