"""What the two-worker test scripts share: the settings their test passes in environment variables, the
MultiWorkerMirroredStrategy over logical CPU devices, and the result file the test reads back.

A script puts tests/ on sys.path and then imports `from workers.common import ...` (pytest has tests/ on
its path too, so a test can load a script's module)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

import torch

import stratagem as sg
from stratagem.devices import DeviceRegistry


def setting(name: str, default: str | None = None) -> str:
    """The test's setting `name` (an environment variable); without a default it must be set."""
    return os.environ[name] if default is None else os.environ.get(name, default)


def sizes(name: str) -> list[int]:
    """Global batch sizes given comma-separated in the setting `name`."""
    return [int(n) for n in setting(name).split(",")]


def multi_worker(
    local: int, timeout: float, *, logical: bool = True, options: Mapping[str, Any] | None = None
) -> sg.MultiWorkerMirroredStrategy:
    """A strategy over this worker's first `local` CPU devices; `logical`: from a registry that splits the CPU
    into max(local, 2) logical devices (else the default registry); `options`: further keyword arguments of the
    strategy. One torch thread: two workers share a core."""
    torch.set_num_threads(1)
    registry = None
    if logical:
        registry = DeviceRegistry()
        registry.set_logical_device_configuration("cpu", max(local, 2))
    return sg.MultiWorkerMirroredStrategy(
        [f"cpu:{i}" for i in range(local)], timeout=timeout, registry=registry, **(options or {})
    )


@contextlib.contextmanager
def strategy_for(
    local: int, timeout: float, *, logical: bool = True, options: Mapping[str, Any] | None = None
) -> Iterator[sg.MultiWorkerMirroredStrategy]:
    """multi_worker(...), closed when the block ends (also when it raises)."""
    strategy = multi_worker(local, timeout, logical=logical, options=options)
    try:
        yield strategy
    finally:
        strategy.close()


def save_per_rank(result: Any, strategy: sg.MultiWorkerMirroredStrategy, name: str) -> None:
    """Every rank saves `result` to <setting name>.<rank> (torch.save)."""
    torch.save(result, f"{setting(name)}.{strategy.cluster.rank}")


def chief_saves_each_case(
    cases: Mapping[Hashable, int],
    train: Callable[[sg.MultiWorkerMirroredStrategy, Any], Any],
    *,
    timeout: float = 60,
    options: Mapping[str, Any] | None = None,
) -> int:
    """Trains every case under a new strategy with the case's number of local replicas (`cases` maps a case to
    it) and `options`, the previous one closed first, so each is built again at the same cluster address. The
    chief saves {case: train(strategy, case)} to MW_OUT; every rank says it is done."""
    results = {}
    rank = None
    for case, local in cases.items():
        with strategy_for(local, timeout, options=options) as strategy:
            rank = strategy.cluster.rank
            results[case] = train(strategy, case)
    if rank == 0:
        torch.save(results, setting("MW_OUT"))
    print(f"rank {rank} done", flush=True)
    return 0


def classify_traced(
    strategy: Any,
    model: Any,
    optimizer: Any,
    batches: Any,
    *,
    clock: Callable[[], int] | None = None,
    mode: str = "spans",
) -> None:
    """Cross-entropy steps of `model` over `batches` (pairs of inputs and labels, cut by the strategy), inside
    `strategy.trace(TR_DIR, clock=clock, mode=mode)` when the test sets TR_DIR, else as they come (STRATAGEM_TRACE,
    set by `stratagem launch --trace`, may be tracing the whole run)."""
    import torch.nn.functional as F

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def train() -> None:
        for x, y in strategy.distribute_dataset(batches):
            strategy.run(train_step, args=(x, y))

    if "TR_DIR" in os.environ:
        with strategy.trace(os.environ["TR_DIR"], clock=clock, mode=mode):
            train()
    else:
        train()
