"""One configuration of `benchmarks/real_models.py`, run in this process: a real model (ResNet-18, a GPT-2,
a BERT classifier, `stratagem.bench.zoo`) trained on the same seeded global batches under plain PyTorch, a
stratagem strategy, DistributedDataParallel or accelerate, timed, with the last step's loss over the
global batch and this process's peak resident memory.

Every configuration starts from the same parameters (seed 0) and reads the same global batches (seed 1),
one new batch a step; the processes of the two-process configurations each take their half of it. The
clock starts after the warm-up steps and stops after the last step; with several processes it starts and
stops at a barrier, so the figure is the slowest rank's.

Example (the smallest shapes, one warm-up and one timed step):
    >>> result = run_plain(MODELS_QUICK["gpt2"], warmup=1, steps=1)
    >>> result.config, result.world
    ('plain', 1)
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from stratagem.bench.multi_process import free_ddp_models
from stratagem.bench.throughput import timed_steps
from stratagem.bench.zoo import ResNet18, adamw_groups, bert, gpt2, make_step


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model's sizes, its global batch and its optimizer, as the benchmark trains it."""

    name: str
    """"resnet18", "gpt2" or "bert"."""
    global_batch: int
    """Examples a step over all replicas (split evenly between two replicas)."""
    width: int
    """The ResNet's first-stage channels; the transformers' hidden size."""
    seq_len: int = 0
    """Tokens an example (the transformers)."""
    layers: int = 0
    """Transformer layers."""
    heads: int = 0
    """Attention heads."""
    vocab: int = 0
    """Vocabulary size (the transformers)."""

    def describe(self) -> str:
        if self.name == "resnet18":
            return (
                f"ResNet-18 width {self.width}, BatchNorm, SGD Nesterov momentum, batch {self.global_batch} x 3x32x32"
            )
        optimizer = "AdamW" if self.name == "gpt2" else "AdamW (2 groups)"
        return (
            f"{'GPT-2' if self.name == 'gpt2' else 'BERT classifier'} {self.layers} layers x {self.width}, "
            f"{self.heads} heads, vocab {self.vocab}, {optimizer} + linear warm-up, batch {self.global_batch} x "
            f"{self.seq_len} tokens"
        )


MODELS = {
    "resnet18": ModelSpec(name="resnet18", global_batch=64, width=64),
    "gpt2": ModelSpec(name="gpt2", global_batch=16, width=256, seq_len=128, layers=4, heads=4, vocab=4096),
    "bert": ModelSpec(name="bert", global_batch=16, width=256, seq_len=128, layers=4, heads=4, vocab=4096),
}
"""The benchmark's sizes: issue 29's (ResNet-18 at torchvision's width; 4-layer, 256-wide transformers)."""

MODELS_QUICK = {
    "resnet18": ModelSpec(name="resnet18", global_batch=4, width=4),
    "gpt2": ModelSpec(name="gpt2", global_batch=4, width=32, seq_len=8, layers=2, heads=2, vocab=48),
    "bert": ModelSpec(name="bert", global_batch=4, width=32, seq_len=8, layers=2, heads=2, vocab=48),
}
"""Tiny shapes that check the harness in seconds (`--quick`)."""

NUM_CLASSES = 10


def build_model(spec: ModelSpec) -> torch.nn.Module:
    """The model with the parameters every configuration starts from."""
    torch.manual_seed(0)
    if spec.name == "resnet18":
        return ResNet18(width=spec.width, num_classes=NUM_CLASSES)
    sizes = dict(vocab=spec.vocab, positions=spec.seq_len, width=spec.width, layers=spec.layers, heads=spec.heads)
    if spec.name == "gpt2":
        return gpt2(**sizes)
    return bert(**sizes, intermediate=4 * spec.width, num_labels=2)


def build_optimizer(spec: ModelSpec, model: torch.nn.Module) -> torch.optim.Optimizer:
    if spec.name == "resnet18":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    if spec.name == "gpt2":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return torch.optim.AdamW(adamw_groups(model), lr=1e-3)


def build_scheduler(spec: ModelSpec, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    """transformers' linear warm-up over a tenth of the run for the transformers; None for the ResNet."""
    if spec.name == "resnet18":
        return None
    from transformers import get_linear_schedule_with_warmup

    return get_linear_schedule_with_warmup(optimizer, max(1, total_steps // 10), total_steps)


def make_batches(spec: ModelSpec, count: int) -> list[Any]:
    """`count` global batches, the same in every process and configuration."""
    g = torch.Generator().manual_seed(1)
    n = spec.global_batch
    batches: list[Any] = []
    for _ in range(count):
        if spec.name == "resnet18":
            batches.append((torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, NUM_CLASSES, (n,), generator=g)))
            continue
        ids = torch.randint(1, spec.vocab, (n, spec.seq_len), generator=g)
        if spec.name == "gpt2":
            # No padding: both halves hold the same number of predicted tokens, so the mean of the replicas'
            # token means is the global batch's.
            batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
            continue
        lengths = torch.randint(spec.seq_len // 4, spec.seq_len + 1, (n,), generator=g)
        mask = (torch.arange(spec.seq_len)[None, :] < lengths[:, None]).long()  # padded as a collator pads
        batches.append(
            {
                "input_ids": ids * mask,
                "token_type_ids": torch.zeros_like(ids),
                "attention_mask": mask,
                "labels": torch.randint(0, 2, (n,), generator=g),
            }
        )
    return batches


def rank_slice(batch: Any, rank: int, world: int) -> Any:
    """Rank `rank`'s contiguous share of a global batch, as a sampler without shuffling gives it."""
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    per = first.shape[0] // world
    part = slice(rank * per, (rank + 1) * per)
    if isinstance(batch, dict):
        return {k: v[part] for k, v in batch.items()}
    return tuple(t[part] for t in batch)


@dataclass(frozen=True, kw_only=True)
class RankResult:
    """What one process of one configuration measured."""

    config: str
    model: str
    rank: int
    world: int
    steps: int
    elapsed_s: float
    """Seconds of the timed steps (the slowest rank's when world > 1)."""
    samples_per_s: float
    final_loss: float
    """The last step's loss over the global batch."""
    peak_rss_mib: float
    """This process's peak resident memory (getrusage ru_maxrss)."""
    threads: int
    """torch's intra-op threads in this process."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def peak_rss_mib() -> float:
    """This process's peak resident set size in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(
    step: Callable[[Any], torch.Tensor], batches: list[Any], warmup: int, barrier: Callable[[], Any] | None
) -> tuple[float, torch.Tensor]:
    """`timed_steps` over `batches`, the first `warmup` of them untimed: `step(batch)` for each."""
    return timed_steps(lambda i: step(batches[i]), warmup, len(batches) - warmup, barrier)


def _result(config: str, spec: ModelSpec, rank: int, world: int, steps: int, elapsed: float, loss: float) -> RankResult:
    return RankResult(
        config=config,
        model=spec.name,
        rank=rank,
        world=world,
        steps=steps,
        elapsed_s=elapsed,
        samples_per_s=steps * spec.global_batch / elapsed,
        final_loss=loss,
        peak_rss_mib=peak_rss_mib(),
        threads=torch.get_num_threads(),
    )


def run_plain(spec: ModelSpec, warmup: int, steps: int) -> RankResult:
    """The one-device loop of plain PyTorch."""
    model = build_model(spec)
    optimizer = build_optimizer(spec, model)
    step = make_step(spec.name, model, optimizer, build_scheduler(spec, optimizer, warmup + steps))
    model.train()
    elapsed, loss = _timed(step, make_batches(spec, warmup + steps), warmup, None)
    return _result("plain", spec, 0, 1, steps, elapsed, float(loss))


def run_strategy(
    config: str, strategy: Any, spec: ModelSpec, warmup: int, steps: int, *, rank: int = 0, world: int = 1
) -> RankResult:
    """The same loop under a stratagem strategy (the port of docs/porting.md): distribute the model and
    optimizer, hand the scheduler over, run the unchanged step on each replica, reduce the loss. `rank`
    and `world`: this process among the strategy's processes (MultiWorkerMirrored), else 0 of 1."""
    net = build_model(spec)
    model, optimizer = strategy.distribute(net, build_optimizer(spec, net))
    scheduler = build_scheduler(spec, optimizer, warmup + steps)
    if scheduler is not None:
        scheduler = strategy.distribute_scheduler(scheduler)
    step = make_step(spec.name, model, optimizer, scheduler)
    model.train()
    batches = list(strategy.distribute_dataset(make_batches(spec, warmup + steps)))
    barrier = dist.barrier if world > 1 else None
    elapsed, loss = _timed(lambda batch: strategy.run(step, args=(batch,)), batches, warmup, barrier)
    return _result(config, spec, rank, world, steps, elapsed, float(strategy.reduce("mean", loss)))


def run_ddp(spec: ModelSpec, warmup: int, steps: int) -> RankResult:
    """DistributedDataParallel in a process group torchrun's variables describe (Gloo): each rank trains
    on its half of every global batch; BatchNorm keeps per-rank statistics (SyncBatchNorm has no CPU
    kernel)."""
    dist.init_process_group("gloo")
    result = _ddp_train(spec, warmup, steps)  # its models freed on return, before the group goes
    free_ddp_models()
    dist.destroy_process_group()
    return result


def _ddp_train(spec: ModelSpec, warmup: int, steps: int) -> RankResult:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.parallel.DistributedDataParallel(build_model(spec))
    optimizer = build_optimizer(spec, model)
    step = make_step(spec.name, model, optimizer, build_scheduler(spec, optimizer, warmup + steps))
    model.train()
    batches = [rank_slice(b, rank, world) for b in make_batches(spec, warmup + steps)]
    elapsed, loss = _timed(step, batches, warmup, dist.barrier)
    dist.all_reduce(loss)
    return _result("ddp", spec, rank, world, steps, elapsed, float(loss) / world)


def run_accelerate(spec: ModelSpec, warmup: int, steps: int) -> RankResult:
    """The loop as an accelerate user writes it (`accelerate launch`): prepare model, optimizer and
    scheduler, `accelerator.backward`, `accelerator.clip_grad_norm_`. `split_batches=True` because each
    rank takes its half of the global batch, so the prepared scheduler steps once a step. `cpu=True`: under
    `accelerate launch --multi_gpu` on a machine without a GPU, accelerate otherwise leaves every process
    training alone (world size 1); with it they form one job, DDP over Gloo (accelerate's MULTI_CPU)."""
    from accelerate import Accelerator, DataLoaderConfiguration

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    result = _accelerate_train(accelerator, spec, warmup, steps)  # its models freed on return
    free_ddp_models()
    accelerator.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


def _accelerate_train(accelerator: Any, spec: ModelSpec, warmup: int, steps: int) -> RankResult:
    rank, world = accelerator.process_index, accelerator.num_processes
    net = build_model(spec)
    optimizer = build_optimizer(spec, net)
    scheduler = build_scheduler(spec, optimizer, warmup + steps)
    if scheduler is None:
        model, optimizer = accelerator.prepare(net, optimizer)
    else:
        model, optimizer, scheduler = accelerator.prepare(net, optimizer, scheduler)
    model.train()

    def step(batch: Any) -> torch.Tensor:
        if spec.name == "resnet18":
            x, y = batch
            loss = torch.nn.functional.cross_entropy(model(x), y)
        else:
            loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        return loss.detach()

    batches = [rank_slice(b, rank, world) for b in make_batches(spec, warmup + steps)]
    elapsed, loss = _timed(step, batches, warmup, accelerator.wait_for_everyone)
    mean = float(accelerator.reduce(loss, reduction="mean"))
    return _result("accelerate", spec, rank, world, steps, elapsed, mean)


def cpu_threads_per_process(world: int) -> int:
    """The intra-op threads each of `world` processes on this machine gets: its share of the cores, as
    DDP users set it (torchrun sets OMP_NUM_THREADS=1)."""
    return max(1, (os.cpu_count() or 1) // world)
