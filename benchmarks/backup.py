"""Issue 26.6's benchmark: how long training waits for a backup, written synchronously or on a thread
(`BackupAndRestore(async_save=True)`), on the 12.6M-parameter MLP with AdamW state (about 150 MB a backup).

    .venv/bin/python benchmarks/backup.py                  # 5 rounds of each, interleaved
    .venv/bin/python benchmarks/backup.py --rounds 9 --dir /fast/disk
    .venv/bin/python benchmarks/backup.py --sharded        # ShardedStrategy, 2 processes: each rank's shards

Synchronous: `save_checkpoint` of the state (torch.save, fsync, renames). Asynchronous: what the step waits
for, the copy of the state into the buffers of the copy before (`snapshot`) and the thread's start (the first
round allocates them, as a run's first save does); the write itself is then waited for outside
the timing, so rounds do not overlap. The two alternate round by round in one process; medians and ranges
are printed with their ratio (the issue asks for at most 0.25).

``--sharded``: two processes on this host (started as `stratagem launch --workers 2` would) shard the same MLP
with ShardedStrategy; synchronous is `save_sharded` (every rank writes and hashes its shards, the chief writes
the state and manifest and renames), asynchronous is what a step waits for in `save_sharded_async` (each rank's
copy of its shards) and the thread's start. Each round starts at a collective; a round's time is the slower
rank's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from stratagem.train.backup.writer import BackgroundWrite, snapshot  # noqa: E402
from stratagem.train.checkpoint import save_checkpoint  # noqa: E402


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
        nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 1024),
    )  # fmt: skip


def state() -> dict:
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 1024)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1}


def sharded_worker(rounds: int, directory: Path) -> None:
    """One rank of ``--sharded``: prints one JSON line of its times (seconds) per round."""
    import stratagem as sg
    from stratagem.train.backup.sharded import save_sharded, save_sharded_async

    strategy = sg.ShardedStrategy()
    net = mlp()
    model, optimizer = strategy.distribute(net, torch.optim.AdamW(net.parameters()))

    def step(x: torch.Tensor) -> None:  # one step, so that the optimizer has its state
        model(x).sum().backward()
        optimizer.step()

    strategy.run(step, args=(torch.randn(4, 1024),))
    shards, rank = strategy.state_shards(), strategy.input_pipeline()[1]
    final, previous = directory / "backup.dcp", directory / "backup.previous.dcp"
    times: dict[str, list[float]] = {"sync": [], "async": [], "write": []}
    writes = BackgroundWrite()
    for step in range(1, rounds + 1):
        chief = {"kind": "fit", "step": 2 * step, "epoch": 0, "step_in_epoch": 2 * step, "strategy": "ShardedStrategy",
                 "num_processes": 2, "optimizer_param_groups": optimizer.state_dict()["param_groups"]}  # fmt: skip
        where = {"is_chief": rank == 0, "previous": previous}
        strategy.reduce("sum", torch.ones(()))
        start = time.perf_counter()
        save_sharded(final, shards, model, optimizer, chief if rank == 0 else {}, step=2 * step - 1, **where)
        times["sync"].append(time.perf_counter() - start)
        strategy.reduce("sum", torch.ones(()))
        start = time.perf_counter()
        write = save_sharded_async(final, shards, model, optimizer, chief if rank == 0 else {}, step=2 * step, **where)
        writes.start(write, str(final))
        times["async"].append(time.perf_counter() - start)
        writes.wait()
        times["write"].append(time.perf_counter() - start)
    print(json.dumps({"rank": rank, **times}), flush=True)
    shards.close()
    strategy.close()


def sharded(rounds: int, directory: Path) -> dict[str, list[float]]:
    """Per round, the slower rank's time of each kind."""
    from stratagem import environ
    from stratagem.cluster import launch

    lines: list[str] = []
    command = [sys.executable, __file__, "--worker", "--rounds", str(rounds), "--dir", str(directory)]
    result = launch(
        command, workers=2, env=dict(environ.current()), sink=lambda line: lines.append(line.text), timeout=900
    )
    rows = [json.loads(t) for t in lines if t.startswith("{")]
    if result.exit_code != 0 or len(rows) != 2:
        raise SystemExit(f"the sharded workers failed (exit code {result.exit_code}):\n" + "\n".join(lines[-30:]))
    return {kind: [max(a, b) for a, b in zip(rows[0][kind], rows[1][kind])] for kind in ("sync", "async", "write")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--sharded", action="store_true", help="ShardedStrategy, 2 processes (see above)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dir is not None and not Path(args.dir).is_dir():
        parser.error(
            f"--dir must be an existing directory. Received: --dir {args.dir}. Create it first, or leave it out."
        )
    if args.worker:
        sharded_worker(args.rounds, Path(args.dir))
        return 0
    if args.sharded:
        with tempfile.TemporaryDirectory(dir=args.dir) as directory:
            times = sharded(args.rounds, Path(directory))
            size = sum(f.stat().st_size for f in (Path(directory) / "backup.dcp").iterdir())
        report(
            f"sharded backup (2 ranks) of {size / 2**20:.0f} MiB",
            args.rounds,
            times["sync"],
            times["async"],
            times["write"],
        )
        return 0
    live = state()
    sync_s, async_s, write_s = [], [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        path, previous = Path(directory) / "backup.pt", Path(directory) / "backup.previous.pt"
        writes = BackgroundWrite()
        copy = None
        for _ in range(args.rounds):
            start = time.perf_counter()
            save_checkpoint(path, live, previous=previous)
            sync_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            copy = snapshot(live, copy)  # as BackupAndRestore does: into the buffers of the copy before
            writes.start(lambda copy=copy: save_checkpoint(path, copy, previous=previous), str(path))
            async_s.append(time.perf_counter() - start)
            writes.wait()
            write_s.append(time.perf_counter() - start)
        size = path.stat().st_size
    report(f"backup of {size / 2**20:.0f} MiB", args.rounds, sync_s, async_s, write_s)
    return 0


def report(what: str, rounds: int, sync_s: list[float], async_s: list[float], write_s: list[float]) -> None:
    ratio = statistics.median(async_s) / statistics.median(sync_s)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{what}, {rounds} rounds each, interleaved; load average (1, 5, 15 min) {load}")
    for name, values in (
        ("synchronous save", sync_s),
        ("async: training waits", async_s),
        ("async: whole write", write_s),
    ):
        print(f"  {name:24s} median {statistics.median(values):.3f} s  (range {min(values):.3f}-{max(values):.3f})")
    print(f"  ratio waits/synchronous: {ratio:.3f}")


if __name__ == "__main__":
    sys.exit(main())
