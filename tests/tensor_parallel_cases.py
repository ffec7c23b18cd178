"""What the tensor-parallel tests' ranks run: a tiny GPT-2 (float64, vocabulary 2049, tied embeddings, -100
labels) trained with AdamW and clipping under TensorParallelStrategy, against the same steps on one device.

The loss is computed here, in float64 (`lm_loss`), not by the model (`output.loss`): transformers' loss casts the
logits to float32, which one device and a `data` axis round differently (see `lm_loss`)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

GLOBAL_BATCH = 13
STEPS = 3
VOCAB = 2049  # odd: the vocabulary split over 2 or 4 workers is uneven, and nothing is padded


def gpt2(heads: int = 6, attention: str = "eager") -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=48, n_layer=2, n_head=heads, tie_word_embeddings=True,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        attn_implementation=attention,
    )  # fmt: skip
    return GPT2LMHeadModel(config).to(torch.float64)


def layout_map(mesh: Any, data_sharded: bool = False) -> Any:
    """Megatron's GPT-2 split in Keras's words: Conv1D weights are (in, out). `data_sharded`: three parameters also
    sharded along `data` (ZeRO-3): the MLP's first weight, the tied embedding (by features) and the final norm."""
    import stratagem as sg

    data = "data" if data_sharded else None
    layouts = sg.LayoutMap(mesh)
    layouts[r"wte\.weight"] = ("model", data)  # the vocabulary, tied to lm_head (a tied one: the root's FSDP unit)
    layouts[r"attn\.c_attn\.weight"] = (None, "model")  # q, k, v: output features (whole heads per worker)
    layouts[r"attn\.c_attn\.bias"] = ("model",)
    layouts[r"attn\.c_proj\.weight"] = ("model", None)  # input features: partial sums, all-reduced
    layouts[r"mlp\.c_fc\.weight"] = (data, "model")  # its input features along data
    layouts[r"mlp\.c_fc\.bias"] = ("model",)
    layouts[r"mlp\.c_proj\.weight"] = ("model", None)
    if data_sharded:
        layouts[r"ln_f\.weight"] = ("data",)  # a LayerNorm, whole along model: gathered whole before its forward
    return layouts


def batches() -> list[dict[str, torch.Tensor]]:
    """Global batches of 13 sequences whose labels end in -100 at varying lengths: slices hold different tokens."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(1, VOCAB, (GLOBAL_BATCH, 8), generator=g)
        labels = ids.clone()
        lengths = torch.randint(2, 9, (GLOBAL_BATCH,), generator=g)
        labels[torch.arange(8)[None, :] >= lengths[:, None]] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The next-token loss in the logits' dtype. transformers' `output.loss` casts float64 logits to float32
    (`ForCausalLMLoss`: `logits.float()`), so its gradient carries float32 rounding: the mean over a data group's
    slice rounds differently from the mean over the whole batch, 6e-8 to 8e-8 relative on every gradient, and
    AdamW grows that to 3e-5 in three steps. A 1-D `model` mesh computes the whole batch's loss on every worker
    and rounds as one device does, so only a `data` axis showed it; the strategy's weighted sum was exact."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def one_device(model: nn.Module) -> tuple[nn.Module, list[float], list[float]]:
    reference = copy.deepcopy(model)
    opt = optimizer(reference.parameters())
    norms, losses = [], []
    for batch in batches():
        loss = lm_loss(reference(input_ids=batch["input_ids"]).logits, batch["labels"])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return reference, norms, losses


def cluster_of(rank: int, ports: list[int]) -> dict[str, Any]:
    return {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": rank}}


def launch_environment(launch: str, rank: int, ports: list[int]) -> dict[str, str]:
    """What each launcher gives this worker's process: `stratagem launch --workers N --strategy tensor_parallel`
    (the launcher's own `task_environments`: TF_CONFIG, torchrun's variables and STRATAGEM_STRATEGY), torchrun's
    variables alone, or SLURM's (srun's, with the rendezvous port stratagem reads there)."""
    from stratagem.cluster.launch import task_environments

    workers = len(ports)
    if launch == "stratagem launch":
        envs = task_environments(
            {}, workers=workers, ports=ports, token="test", keep_freed_memory=False, strategy="tensor_parallel"
        )
        return {k: v for k, v in envs[f"worker:{rank}"].items() if k != "OMP_NUM_THREADS"}
    if launch == "torchrun":
        return {
            "RANK": str(rank), "WORLD_SIZE": str(workers), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(workers),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[0]),
        }  # fmt: skip
    assert launch == "SLURM", launch
    return {
        "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(workers), "SLURM_LOCALID": str(rank),
        "SLURM_NTASKS_PER_NODE": str(workers), "MASTER_ADDR": "127.0.0.1", "STRATAGEM_MASTER_PORT": str(ports[0]),
    }  # fmt: skip


def exactness(
    rank: int,
    ports: list[int],
    shape: tuple[int, ...] | None,
    names: tuple[str, ...] | None,
    data_sharded: bool = False,
    directory: str | None = None,
    launch: str | None = None,
) -> dict[str, Any]:
    """Trains under TensorParallelStrategy on the mesh (shape, names); every parameter, clipped norm and loss against
    one device, what explain() says, and the memory plan's parts beside what the rank holds (`data_sharded`:
    `layout_map`'s ZeRO-3 layouts). With `directory`: a backup after the first step (`state_shards`, as
    `tensor_parallel_checkpoint_cases` writes one) and the whole values after the first two steps. With `launch`
    (`launch_environment`'s names): the strategy is `sg.strategy_from_env(layout_map=...)` in that launcher's
    environment, and `shape` None leaves the layout map without a mesh (the default: one `model` axis)."""
    import os
    from pathlib import Path

    from torch.distributed.tensor import DTensor

    import stratagem as sg
    from stratagem.strategies.state_memory import measured_local_bytes
    from stratagem.strategies.tensor_parallel.apply import whole_tensor
    from stratagem.train.backup.sharded import save_sharded

    user_model = gpt2()
    reference, ref_norms, ref_losses = one_device(user_model)
    mesh = None if shape is None else sg.DeviceMesh(shape, names)
    if launch is None:
        strategy = sg.TensorParallelStrategy(
            layout_map(mesh, data_sharded), cluster=cluster_of(rank, ports), timeout=120
        )
    else:
        os.environ.update(launch_environment(launch, rank, ports))  # this spawned rank's own environment
        strategy = sg.strategy_from_env(layout_map=layout_map(mesh, data_sharded))
    try:
        model, opt = strategy.distribute(user_model, optimizer(user_model.parameters()))
        norms, losses = [], []
        # The activations of a layer split along its output features: this worker's part only (the first call).
        c_fc_outputs: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

        def record_c_fc(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            local = out.to_local() if isinstance(out, DTensor) else out
            c_fc_outputs.append((tuple(out.shape), tuple(local.shape)))

        user_model.transformer.h[0].mlp.c_fc.register_forward_hook(record_c_fc)

        def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            loss = lm_loss(model(input_ids=batch["input_ids"]).logits, batch["labels"])
            sg.set_loss_weight((batch["labels"][:, 1:] != -100).sum())
            loss.backward()
            norms.append(float(whole_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))))
            opt.step()
            opt.zero_grad()
            return loss.detach()

        after: list[dict[str, Any]] = []
        for batch in strategy.distribute_dataset(batches()):
            losses.append(float(strategy.reduce("mean", strategy.run(step, args=(batch,)))))
            if directory is not None and len(after) < 2:
                after.append({n: whole_tensor(p).detach().numpy().copy() for n, p in model.module.named_parameters()})
            if directory is not None and len(after) == 1:
                state = {
                    "step": 1, "epoch": 0, "step_in_epoch": 1, "strategy": "tensor_parallel",
                    "num_processes": len(ports), "optimizer_param_groups": opt.state_dict()["param_groups"],
                }  # fmt: skip
                backup = Path(directory) / "backup.dcp"
                save_sharded(backup, strategy.state_shards(), model.module, opt, state, step=1, is_chief=strategy.is_chief, previous=None)  # fmt: skip
        expected = dict(reference.named_parameters())
        worst = max(
            float((whole_tensor(p).detach() - expected[name]).abs().max() / expected[name].abs().max())
            for name, p in model.named_parameters()
        )
        local_shapes = {
            name: tuple(p.to_local().shape) for name, p in model.named_parameters() if hasattr(p, "to_local")
        }
        states = {name: tuple(opt.state[p]["exp_avg"].to_local().shape) for name, p in model.named_parameters()}
        return {
            "worst": worst,
            "norms": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
            "losses": max(abs(a - b) / b for a, b in zip(losses, ref_losses)),
            "wte local": local_shapes["transformer.wte.weight"],
            "local shapes": local_shapes,
            "state shapes": states,
            "same model": model.module is user_model,
            "strategy": type(strategy).__name__,
            "cluster source": strategy.cluster.source,
            "c_fc output": c_fc_outputs[0],
            "plan": strategy.memory_plan().to_dict(),
            "held": measured_local_bytes(model.parameters(), opt),
            "after": after,
            "explain": str(strategy.explain()),
        }
    finally:
        strategy.close()
