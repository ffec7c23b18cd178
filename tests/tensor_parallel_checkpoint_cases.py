"""What the tensor-parallel checkpoint test's ranks run: the tiny GPT-2 of tensor_parallel_cases trained a step at
2 model workers and backed up (each worker its own parts, torch.distributed.checkpoint), a second step there; then
the backup resumed at 1 or 3 workers, which take the second step. Whole values come back as numpy arrays."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tensor_parallel_cases as cases
import torch


def _step(model: Any, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> None:
    import stratagem as sg

    loss = cases.lm_loss(model(input_ids=batch["input_ids"]).logits, batch["labels"])
    # The mean over the tokens with a label: on a data axis each group's mean weighs by its count, so a step there
    # is one device's step, as on a model axis alone (tensor_parallel_cases.py).
    sg.set_loss_weight((batch["labels"][:, 1:] != -100).sum())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    optimizer.zero_grad()


def _whole(model: Any) -> dict[str, Any]:
    from stratagem.strategies.tensor_parallel.apply import whole_tensor

    return {name: whole_tensor(p).detach().numpy().copy() for name, p in model.module.named_parameters()}


def write_at_two(rank: int, ports: list[int], directory: str) -> dict[str, Any]:
    """Two model workers, or, on four ranks, a 2 x 2 mesh of data and model workers."""
    import stratagem as sg
    from stratagem.train.backup.sharded import save_sharded

    mesh = sg.DeviceMesh((2,), ("model",)) if len(ports) == 2 else sg.DeviceMesh((2, 2), ("data", "model"))
    strategy = sg.TensorParallelStrategy(cases.layout_map(mesh), cluster=cases.cluster_of(rank, ports), timeout=120)
    try:
        user = cases.gpt2()
        model, optimizer = strategy.distribute(user, cases.optimizer(user.parameters()))
        batches = list(strategy.distribute_dataset(cases.batches()))
        strategy.run(_step, args=(model, optimizer, batches[0]))
        after_one = _whole(model)
        state = {
            "step": 1, "epoch": 0, "step_in_epoch": 1, "strategy": "tensor_parallel", "num_processes": len(ports),
            "optimizer_param_groups": optimizer.state_dict()["param_groups"],
        }  # fmt: skip
        backup = Path(directory) / "backup.dcp"
        save_sharded(backup, strategy.state_shards(), model.module, optimizer, state, step=1, is_chief=strategy.is_chief, previous=None)  # fmt: skip
        strategy.run(_step, args=(model, optimizer, batches[1]))
        return {"after one": after_one, "after two": _whole(model)}
    finally:
        strategy.close()


def resume(rank: int, ports: list[int], directory: str) -> dict[str, Any]:
    """The backup read at len(ports) model workers, and the second step taken there."""
    import stratagem as sg
    from stratagem.train.checkpoint import load_checkpoint

    mesh = sg.DeviceMesh((len(ports),), ("model",))
    strategy = sg.TensorParallelStrategy(cases.layout_map(mesh), cluster=cases.cluster_of(rank, ports), timeout=120)
    try:
        user = cases.gpt2()
        with torch.no_grad():  # other values than the backup's, so that loading is seen
            for p in user.parameters():
                p.add_(1.0)
        model, optimizer = strategy.distribute(user, cases.optimizer(user.parameters()))
        backup = Path(directory) / "backup.dcp"
        groups = load_checkpoint(backup / "state.pt")["optimizer_param_groups"]
        strategy.state_shards().load(backup, model.module, optimizer, groups)
        loaded = _whole(model)
        batches = list(strategy.distribute_dataset(cases.batches()))
        strategy.run(_step, args=(model, optimizer, batches[1]))
        return {"loaded": loaded, "after two": _whole(model)}
    finally:
        strategy.close()
