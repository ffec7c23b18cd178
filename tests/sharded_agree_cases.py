"""What the ranks of tests/test_sharded_agree.py run: ShardedStrategy's batch agreement (issue 27, item 6), its
barrier, and `distribute_dataset` with `batch_dim=1` and `shard="off"`/`"file"`, against one device in float64."""

from __future__ import annotations

import copy
import io
import pickle
import time
from typing import Any

import torch
from sharded_cases import batches, full, loss_fn, mlp


def _cluster(rank: int, ports: list[int]) -> dict[str, Any]:
    return {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": rank}}


def _one_device(data: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.nn.Module:
    reference = mlp(torch.float64)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        loss_fn(reference, x, y).backward()
        opt.step()
        opt.zero_grad()
    return reference


def _worst(model: Any, reference: torch.nn.Module) -> float:
    return max(
        float((full(p).detach() - q.detach()).abs().max() / q.detach().abs().max())
        for p, q in zip(model.module.parameters(), reference.parameters())
    )


def _train(strategy: Any, distributed: Any, shapes: list[tuple[int, ...]] | None = None) -> tuple[Any, int]:
    """A fresh MLP distributed and trained on `distributed` (SGD with momentum); the model and the steps made.
    `shapes` receives the shape of each step's `x` as the step function sees it."""
    user_model = mlp(torch.float64)
    model, opt = strategy.distribute(user_model, torch.optim.SGD(user_model.parameters(), lr=0.1, momentum=0.9))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if shapes is not None:
            shapes.append(tuple(x.shape))
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    steps = 0
    for x, y in distributed:
        strategy.run(step, args=(x, y))
        steps += 1
    return model, steps


def agreement_case(rank: int, ports: list[int]) -> dict[str, Any]:
    """Two workers, one strategy: equal batches, batch_dim=1, shard="off" and "file", the barrier, then rank 1
    handed another batch at the second step (the last case: both workers stop there)."""
    import stratagem as sg

    strategy = sg.ShardedStrategy(cluster=_cluster(rank, ports), timeout=60)
    out: dict[str, Any] = {}
    try:
        data = batches(torch.float64, [13, 13, 9])
        model, out["equal steps"] = _train(strategy, strategy.distribute_dataset(data))
        reference = _one_device(data)
        out["equal worst"] = _worst(model, reference)
        out["copies refused"] = []
        for copy_model in (
            lambda: torch.save(model, io.BytesIO()),
            lambda: pickle.dumps(model),
            lambda: copy.deepcopy(model),
        ):
            try:
                copy_model()
                out["copies refused"].append("copied")
            except sg.InputError as error:
                out["copies refused"].append(str(error))
        # The fix the error gives: the whole state gathered on every rank, saved on the chief.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        buffer = io.BytesIO()
        torch.save(whole, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer)
        out["saved whole worst"] = max(
            float((loaded[k] - v).abs().max() / v.abs().max()) for k, v in reference.state_dict().items()
        )

        # (seq, batch, features): the batch along dimension 1, cut there; one device sees the whole tensors.
        g = torch.Generator().manual_seed(2)
        seq = [
            (
                torch.randn(4, n, 6, generator=g, dtype=torch.float64),
                torch.randn(4, n, 3, generator=g, dtype=torch.float64),
            )
            for n in (13, 8)
        ]
        out["batch_dim shapes"] = []
        model, out["batch_dim steps"] = _train(
            strategy, strategy.distribute_dataset(seq, batch_dim=1), out["batch_dim shapes"]
        )
        out["batch_dim worst"] = _worst(model, _one_device(seq))

        # shard="off": each worker's loader yields its own part (7 and 6 examples of a global batch of 13).
        whole = batches(torch.float64, [13, 13])
        own = [(x[:7], y[:7]) if rank == 0 else (x[7:], y[7:]) for x, y in whole]
        model, out["off steps"] = _train(strategy, strategy.distribute_dataset(own, shard="off"))
        out["off worst"] = _worst(model, _one_device(whole))
        try:
            strategy.distribute_dataset(whole, shard="file")
            out["file"] = "accepted"
        except sg.InputError as error:
            out["file"] = str(error)

        start = time.monotonic()
        strategy.barrier()
        strategy.barrier()
        out["barriers"] = time.monotonic() - start

        other = batches(torch.float64, [13, 13])
        if rank == 1:
            other[1] = (other[1][0] + 1.0, other[1][1])  # this worker's second global batch differs in x
        try:
            _, out["disagree steps"] = _train(strategy, strategy.distribute_dataset(other))
        except sg.InputError as error:
            out["disagree"] = str(error)
    finally:
        strategy.close()
    return out


def check_off_then_missing_barrier_case(rank: int, ports: list[int], timeout: float) -> dict[str, Any]:
    """check_batches=False on every worker: rank 1's other batches train without a word. Then rank 0 waits at the
    barrier and rank 1 never arrives (it stays alive, then leaves)."""
    import stratagem as sg

    strategy = sg.ShardedStrategy(cluster=_cluster(rank, ports), timeout=timeout, check_batches=False)
    out: dict[str, Any] = {}
    try:
        data = batches(torch.float64, [13, 13])
        if rank == 1:
            data = [(x + 1.0, y) for x, y in data]
        _, out["steps"] = _train(strategy, strategy.distribute_dataset(data))
        if rank == 0:
            start = time.monotonic()
            try:
                strategy.barrier()
                out["error"] = None
            except sg.CollectiveTimeoutError as error:
                out["error"] = str(error)
            out["waited"] = time.monotonic() - start
        else:
            time.sleep(timeout + 15.0)
    finally:
        strategy.close()
    return out


def check_batches_setter_case(rank: int, ports: list[int], timeout: float) -> dict[str, Any]:
    """`strategy.check_batches` set between steps: off on every worker (other batches train), on again (an
    evaluation step on other batches is stopped at its end; a training step before its first reduce-scatter, its
    shards unchanged), then off on rank 1 only with a new model: rank 0 names rank 1. The batches that differ are
    rank 1's, its x plus 1."""
    import stratagem as sg

    strategy = sg.ShardedStrategy(cluster=_cluster(rank, ports), timeout=timeout)
    out: dict[str, Any] = {"refused": None}
    try:
        try:
            strategy.check_batches = "off"  # type: ignore[assignment]
        except sg.InputError as error:
            out["refused"] = str(error)
        user_model = mlp(torch.float64)
        model, opt = strategy.distribute(user_model, torch.optim.SGD(user_model.parameters(), lr=0.1))
        events: list[str] = []

        def train(x: torch.Tensor, y: torch.Tensor) -> None:
            loss_fn(model, x, y).backward()
            events.append("backward")
            opt.step()
            events.append("update")
            opt.zero_grad()

        def evaluate(x: torch.Tensor, y: torch.Tensor) -> None:
            with torch.no_grad():
                loss_fn(model, x, y)
            events.append("evaluated")

        def differing(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            data = batches(torch.float64, [13] * n)
            return [(x + 1.0, y) for x, y in data] if rank == 1 else data

        def shards() -> list[torch.Tensor]:
            return [p.to_local().detach().clone() for p in model.module.parameters()]

        def steps(fn: Any, data: list[Any]) -> str | None:
            try:
                for x, y in strategy.distribute_dataset(data):
                    strategy.run(fn, args=(x, y))
            except sg.InputError as error:
                return str(error)
            return None

        out["on at first"] = strategy.check_batches
        strategy.check_batches = False
        out["off"] = steps(train, differing(2)), list(events)
        strategy.check_batches = True
        events.clear()
        out["evaluation"] = steps(evaluate, differing(1)), list(events)
        events.clear()
        before = shards()
        out["training"] = steps(train, differing(1)), list(events)
        out["shards unchanged"] = all(torch.equal(a, b) for a, b in zip(before, shards()))

        # A new model (the one above stopped inside its backward); rank 1 turns the check off, rank 0 does not.
        user_model = mlp(torch.float64)
        model, opt = strategy.distribute(user_model, torch.optim.SGD(user_model.parameters(), lr=0.1))
        strategy.check_batches = rank == 0
        try:
            out["mixed"] = steps(train, batches(torch.float64, [13]))
        except Exception as error:  # noqa: BLE001 - rank 1 is left in a collective rank 0 never makes
            out["mixed"] = f"{type(error).__name__}: {error}"
        return out
    finally:
        strategy.close()
