"""Sharded backups with real processes on 127.0.0.1: saved under one strategy and number of workers, resumed
under another, ending with the parameters of an uninterrupted run, every example trained on once per epoch;
a flipped byte in a shard refused with its file and rank, and the previous backup used.

Each save runs once per module (tests/workers/resume_matrix.py: 52 examples in global batches of 13, 4
steps an epoch, 3 epochs; AdamW in float64; backups after steps 3 and 6, stopped after step 7, so every
resume starts at step 6, mid-epoch 2, and trains 6 more steps)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from workers.resume_matrix import BATCH_SIZE, EPOCHS, NUM_EXAMPLES, SHUFFLE_SEED, build_model, data, loss_on

from stratagem import environ
from stratagem.cluster import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.sharded]

WORKER = str(Path(__file__).parent / "workers" / "resume_matrix.py")
STOP_AFTER = 7
SAVES = {"one_device": 1, "mirrored": 1, "multi_worker": 2, "sharded": 2}
RESUMES = [("one_device", 1), ("multi_worker", 3), ("sharded", 3), ("sharded", 1)]


def run(kind: str, workers: int, backup: Path, out: Path, log: Path, check: bool = True, **settings: object) -> str:
    """Runs the worker (under the launcher for a multi-process strategy); returns its output, failing on an error
    (unless `check` is False)."""
    env = dict(environ.current())
    env.update({"RM_STRATEGY": kind, "RM_BACKUP": str(backup), "RM_OUT": str(out), "RM_LOG": str(log)})
    env.update({k: str(v) for k, v in settings.items()})
    log.mkdir(parents=True, exist_ok=True)
    if kind in ("one_device", "mirrored"):
        done = subprocess.run([sys.executable, WORKER], env=env, capture_output=True, timeout=120, check=False)
        output = done.stdout.decode() + done.stderr.decode()
        assert done.returncode == 0, output[-3000:]
        return output
    lines: list[str] = []
    result = launch(
        [sys.executable, WORKER],
        workers=workers,
        env=env,
        timeout=120,
        grace_period=2,
        sink=lambda line: lines.append(f"[{line.task}] {line.text}"),
    )
    assert (result.exit_code == 0) == check, result.explain() + "\n" + "\n".join(lines[-40:])
    return "\n".join(lines)


def reference(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One device, the documented order of ShuffledBatches: epoch e is torch.randperm(n) from a generator seeded
    seed * 1_000_003 + e + 1."""
    x, target = data(dtype)
    model, optimizer = build_model(dtype)
    for epoch in range(EPOCHS):
        order = torch.randperm(
            NUM_EXAMPLES, generator=torch.Generator().manual_seed(SHUFFLE_SEED * 1_000_003 + epoch + 1)
        )
        for idx in order.split(BATCH_SIZE):
            loss_on(model(x[idx]), target[idx]).backward()
            optimizer.step()
            optimizer.zero_grad()
    return model.state_dict()


def logged_steps(log: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(log.glob("*.jsonl")) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One interrupted run per saving strategy: its backup directory and index log, shared by the resumes."""
    out = {}
    for kind, workers in SAVES.items():
        root = tmp_path_factory.mktemp(f"save-{kind}")
        run(kind, workers, root / "backup", root / "out.pt", root / "log", RM_STOP_AFTER=STOP_AFTER)
        out[kind] = root
    return out


@pytest.fixture(scope="module")
def expected() -> dict[str, torch.Tensor]:
    return reference(torch.float64)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("resume_kind, resume_workers", RESUMES, ids=[f"{k}x{n}" for k, n in RESUMES])
@pytest.mark.parametrize("save_kind", list(SAVES))
def test_a_backup_resumes_under_another_strategy_and_worker_count_like_an_uninterrupted_run(
    tmp_path, saved, expected, save_kind, resume_kind, resume_workers
):
    shutil.copytree(saved[save_kind] / "backup", tmp_path / "backup")
    form = "backup.dcp" if save_kind == "sharded" else "backup.pt"
    assert (tmp_path / "backup" / form).exists()
    run(resume_kind, resume_workers, tmp_path / "backup", tmp_path / "out.pt", tmp_path / "log")
    result = torch.load(tmp_path / "out.pt")
    assert result["restored_from"] == {"epoch": 1, "step": 6}
    worst = max(float((result["state"][name] - value).abs().max()) for name, value in expected.items())
    assert worst <= 1e-9, worst
    # The data position carried over: the steps before the backup, then the resumed ones, hold every example
    # exactly once per epoch (mirrored logs each replica thread's slices in one process).
    steps = [s for s in logged_steps(saved[save_kind] / "log") if s["step"] <= 6] + logged_steps(tmp_path / "log")
    for epoch in range(EPOCHS):
        indices = sorted(i for s in steps if s["epoch"] == epoch for i in s["indices"])
        assert indices == list(range(NUM_EXAMPLES)), (epoch, len(indices))


@pytest.mark.timeout(300)
def test_a_flipped_byte_in_one_ranks_shard_is_refused_naming_it_and_the_previous_backup_is_used(
    tmp_path, saved, expected
):
    shutil.copytree(saved["sharded"] / "backup", tmp_path / "backup")
    shard = tmp_path / "backup" / "backup.dcp" / "__1_0.distcp"
    data_bytes = bytearray(shard.read_bytes())
    data_bytes[len(data_bytes) // 2] ^= 0x10
    shard.write_bytes(bytes(data_bytes))
    output = run("sharded", 2, tmp_path / "backup", tmp_path / "out.pt", tmp_path / "log")
    assert "its file '__1_0.distcp' (written by rank 1) differs from what was written" in output
    result = torch.load(tmp_path / "out.pt")
    assert result["restored_from"] == {"epoch": 0, "step": 3}  # the previous backup
    worst = max(float((result["state"][name] - value).abs().max()) for name, value in expected.items())
    assert worst <= 1e-9, worst
    # Moved out of the way at the first save, so it never became the previous backup.
    assert (tmp_path / "backup" / "backup.corrupt.dcp" / "__1_0.distcp").read_bytes() == bytes(data_bytes)


@pytest.mark.timeout(300)
def test_in_float32_a_sharded_backup_of_two_workers_resumes_at_three_within_1e_6(tmp_path):
    run(
        "sharded",
        2,
        tmp_path / "backup",
        tmp_path / "first.pt",
        tmp_path / "log",
        RM_STOP_AFTER=STOP_AFTER,
        RM_DTYPE="float32",
    )
    run("sharded", 3, tmp_path / "backup", tmp_path / "out.pt", tmp_path / "log", RM_DTYPE="float32")
    result = torch.load(tmp_path / "out.pt")
    assert result["restored_from"] == {"epoch": 1, "step": 6}
    expected = reference(torch.float32)
    worst = max(float((result["state"][name] - value).abs().max()) for name, value in expected.items())
    assert worst <= 1e-6, worst


@pytest.mark.timeout(300)
def test_an_asynchronous_sharded_backup_resumes_like_an_uninterrupted_run(tmp_path, expected):
    run("sharded", 2, tmp_path / "backup", tmp_path / "first.pt", tmp_path / "log", RM_STOP_AFTER=7, RM_ASYNC=1)
    # Waited for at the end of training: the backup of step 6 is in place, whole, and the one of step 3 kept.
    assert json.loads((tmp_path / "backup" / "backup.dcp" / "manifest.json").read_text())["step"] == 6
    assert json.loads((tmp_path / "backup" / "backup.previous.dcp" / "manifest.json").read_text())["step"] == 3
    run("sharded", 2, tmp_path / "backup", tmp_path / "out.pt", tmp_path / "log2", RM_ASYNC=1)
    result = torch.load(tmp_path / "out.pt")
    assert result["restored_from"] == {"epoch": 1, "step": 6}
    worst = max(float((result["state"][name] - value).abs().max()) for name, value in expected.items())
    assert worst <= 1e-9, worst


@pytest.mark.timeout(300)
def test_a_chief_killed_during_the_background_write_leaves_the_backup_before_for_the_resume(tmp_path, expected):
    output = run(
        "sharded", 2, tmp_path / "backup", tmp_path / "first.pt", tmp_path / "log", check=False,
        RM_STOP_AFTER=7, RM_ASYNC=1, RM_KILL_AT=6,
    )  # fmt: skip
    assert "killed while writing the backup of step 6" in output
    # Training went on while the backup of step 6 was written: the chief trained step 7 before it was killed.
    chief_steps = [json.loads(line)["step"] for p in (tmp_path / "log").glob("*rank0.jsonl") for line in p.open()]
    assert chief_steps == [1, 2, 3, 4, 5, 6, 7], chief_steps
    left = sorted(p.name for p in (tmp_path / "backup").iterdir() if p.name.startswith(".stratagem-partial"))
    assert len(left) == 1 and (tmp_path / "backup" / left[0] / "state.pt").is_file()  # all but the manifest
    assert json.loads((tmp_path / "backup" / "backup.dcp" / "manifest.json").read_text())["step"] == 3
    run("sharded", 2, tmp_path / "backup", tmp_path / "out.pt", tmp_path / "log2", RM_ASYNC=1)
    result = torch.load(tmp_path / "out.pt")
    assert result["restored_from"] == {"epoch": 0, "step": 3}
    worst = max(float((result["state"][name] - value).abs().max()) for name, value in expected.items())
    assert worst <= 1e-9, worst
    assert not any(p.name.startswith(".stratagem-partial") for p in (tmp_path / "backup").iterdir())
