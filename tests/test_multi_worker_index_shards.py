"""Under MultiWorkerMirroredStrategy each worker reads only its part of every global batch (index-level
sharding, data/worker_shards.py) and training still equals one device on the global batches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from workers.mwms_index_shards import BATCH_SIZE, EPOCHS, FIT_SEED, build, data, loader_generator

from stratagem import environ
from stratagem.cluster import launch
from stratagem.data.resume import ShuffledBatches

WORKER = str(Path(__file__).parent / "workers" / "mwms_index_shards.py")
pytestmark = [pytest.mark.multiprocess]


def _global_batches():
    """The loop's and then fit's global batches, each with its example indices, as one device sees them."""
    x, y = data()
    indexed = TensorDataset(x, y, torch.arange(len(x)))
    loader = DataLoader(indexed, batch_size=BATCH_SIZE, shuffle=True, generator=loader_generator())
    loop = [batch for _ in range(EPOCHS) for batch in loader]
    source = ShuffledBatches((x, y, torch.arange(len(x))), batch_size=BATCH_SIZE, seed=FIT_SEED)
    fitted = [batch for _ in range(EPOCHS) for batch in source]
    loader = DataLoader(indexed, batch_size=BATCH_SIZE, shuffle=True, generator=loader_generator())
    accumulated = list(loader)
    return loop, fitted, accumulated


def _train_plain(model, optimizer, batches):
    """One device, the mean loss over each global batch; returns each epoch's mean loss over its examples."""
    losses, sums = [], [0.0, 0]
    per_epoch = len(batches) // EPOCHS
    for i, (xb, yb, _) in enumerate(batches):
        loss = F.mse_loss(model(xb), yb)
        sums[0] += float(loss.detach()) * len(yb)
        sums[1] += len(yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if (i + 1) % per_epoch == 0:
            losses.append(sums[0] / sums[1])
            sums = [0.0, 0]
    return losses


PER_PASS = 4
"""Global batches in a pass over the 27 examples."""


def _halves(batches):
    """What each of 2 workers (1 replica each) should read: the first ceil(n/2) indices of each batch, then the rest;
    and first, at each pass's start, the first example of its first batch (the batch check's read, data/probe.py)."""
    first, second = [], []
    for position, (_, _, index) in enumerate(batches):
        if position % PER_PASS == 0:
            first.append(int(index[0]))
            second.append(int(index[0]))
        cut = (len(index) + 1) // 2
        first += index[:cut].tolist()
        second += index[cut:].tolist()
    return first, second


@pytest.mark.timeout(240)
def test_each_worker_reads_only_its_part_and_training_equals_one_device(tmp_path):
    out = tmp_path / "result.pt"
    env = dict(environ.current())
    env["MW_OUT"] = str(out)
    lines: list[str] = []
    result = launch(
        [sys.executable, WORKER],
        workers=2,
        env=env,
        sink=lambda line: lines.append(f"[{line.task}] {line.text}"),
        timeout=180,
        grace_period=2,
    )
    assert result.exit_code == 0, "\n".join(lines[-30:])
    saved = [torch.load(f"{out}.{rank}") for rank in (0, 1)]

    loop, fitted, accumulated = _global_batches()
    model, optimizer = build()
    _train_plain(model, optimizer, loop)
    after_loop = {k: v.clone() for k, v in model.state_dict().items()}
    fit_losses = _train_plain(model, optimizer, fitted)
    after_fit = {k: v.clone() for k, v in model.state_dict().items()}
    # accumulate_steps=2: one update per pair of batches, on the mean loss over the pair's examples.
    pairs = [accumulated[i : i + 2] for i in range(0, len(accumulated), 2)]
    merged = [tuple(torch.cat([b[k] for b in pair]) for k in range(3)) for pair in pairs]
    _train_plain(model, optimizer, merged)
    x, y = data()
    val_loss = float(F.mse_loss(model(x[:10]), y[:10]).detach())

    # Each worker asked its data set for its part only, in the order of the global batches: half of them, and
    # one example a pass that every worker reads for the batch check.
    for phase, batches in (("loop_asked", loop), ("fit_asked", fitted), ("accumulate_asked", accumulated)):
        expected = _halves(batches)
        for rank in (0, 1):
            assert saved[rank][phase] == expected[rank], phase
        assert len(saved[0][phase]) + len(saved[1][phase]) == len(batches) // PER_PASS * (27 + 2)
    for rank in (0, 1):
        for phase, expected_state in (
            ("after_loop", after_loop),
            ("after_fit", after_fit),
            ("after_accumulate", model.state_dict()),
        ):
            for key, value in expected_state.items():
                torch.testing.assert_close(saved[rank][phase][key], value, rtol=0, atol=1e-9, msg=phase)
        assert saved[rank]["val_loss"] == pytest.approx([val_loss], abs=1e-9)
        # The epoch's loss and example count are the global ones: the parts carried each step's global size.
        assert saved[rank]["examples"] == [27, 27]
        assert saved[rank]["losses"] == pytest.approx(fit_losses, abs=1e-9)
    explain = saved[0]
    assert "input sharding: index level - the input (DataLoader)" in explain["explain_loop"], explain["explain_loop"]
    assert "input sharding: index level - the input (ShuffledBatches)" in explain["explain_fit"], explain["explain_fit"]
    # Validation batches given as a list are sliced, but the training data's decision stands.
    assert "input sharding: index level - the input (DataLoader)" in explain["explain_accumulate"]
    assert (
        "input sharding: each worker slices every global batch - the DataLoader reads an IterableDataset"
        in explain["explain_stream"]
    ), explain["explain_stream"]
