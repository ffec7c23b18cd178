"""Issue 26.6's benchmark: how long training waits for a single-file backup, written synchronously or on a thread
(`BackupAndRestore(async_save=True)`), on the 12.6M-parameter MLP with AdamW state (about 150 MB a backup).

    .venv/bin/python benchmarks/backup.py                  # 5 rounds of each, interleaved
    .venv/bin/python benchmarks/backup.py --rounds 9 --dir /fast/disk

Synchronous: `save_checkpoint` of the state (torch.save, fsync, renames). Asynchronous: what the step waits
for, the copy of the state into the buffers of the copy before (`snapshot`) and the thread's start (the first
round allocates them, as a run's first save does); the write itself is then waited for outside
the timing, so rounds do not overlap. The two alternate round by round in one process; medians and ranges
are printed with their ratio (the issue asks for at most 0.25).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from stratagem.train.backup_writer import BackgroundWrite, snapshot  # noqa: E402
from stratagem.train.checkpoint import save_checkpoint  # noqa: E402


def state() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
        nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 1024),
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 1024)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
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
    ratio = statistics.median(async_s) / statistics.median(sync_s)
    print(f"backup of {size / 2**20:.0f} MiB, {args.rounds} rounds each, interleaved")
    for name, values in (
        ("synchronous save", sync_s),
        ("async: training waits", async_s),
        ("async: whole write", write_s),
    ):
        print(f"  {name:24s} median {statistics.median(values):.3f} s  (range {min(values):.3f}-{max(values):.3f})")
    print(f"  ratio waits/synchronous: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
