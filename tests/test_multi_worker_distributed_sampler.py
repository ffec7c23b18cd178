"""A DDP script's DataLoader with a DistributedSampler under MultiWorkerMirroredStrategy: each worker's
loader is read whole as its own part (never cut again), and a step's global batch is every worker's
batch together, so training equals one device on those global batches; the in-process checks of the
wrapping are in tests/test_worker_shards.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import launch_workers
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from workers.mwms_distributed_sampler import BATCH_SIZE, EPOCHS, FIT_SEED, LOOP_SEED, build, dataset

pytestmark = [pytest.mark.multiprocess]


def _global_batches(seed):
    """Per epoch, DDP's global batches: batch i of rank 0's loader, then batch i of rank 1's."""
    data = dataset()
    out = []
    for epoch in range(EPOCHS):
        per_rank = []
        for rank in (0, 1):
            sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=seed)
            sampler.set_epoch(epoch)
            per_rank.append(list(DataLoader(data, batch_size=BATCH_SIZE, sampler=sampler)))
        out.append([tuple(torch.cat([a[k], b[k]]) for k in range(2)) for a, b in zip(*per_rank)])
    return out


def _train_plain(model, optimizer, batches, k=1):
    """One device: one update per group of k global batches, on the mean loss over the group's examples."""
    for start in range(0, len(batches), k):
        group = batches[start : start + k]
        x, y = torch.cat([b[0] for b in group]), torch.cat([b[1] for b in group])
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.timeout(240)
def test_a_distributed_sampler_loader_is_each_workers_part_and_training_equals_one_device(tmp_path):
    out = tmp_path / "result.pt"
    exit_code, output = launch_workers("mwms_distributed_sampler.py", {"MW_OUT": str(out)}, timeout=200)
    assert exit_code == 0, output
    saved = torch.load(out)
    for local in (1, 2):
        model, optimizer = build()
        for epoch in _global_batches(LOOP_SEED):
            _train_plain(model, optimizer, epoch)
        after_loop = {k: v.clone() for k, v in model.state_dict().items()}
        for epoch in _global_batches(FIT_SEED):
            _train_plain(model, optimizer, epoch, k=local)  # fit's accumulate_steps=local
        for phase, expected in (("after_loop", after_loop), ("after_fit", model.state_dict())):
            for key, value in expected.items():
                torch.testing.assert_close(
                    saved[local][phase][key],
                    value,
                    rtol=0,
                    atol=1e-9,
                    msg=lambda m, p=phase, k=key: f"{local} local, {p}, {k}: {m}",
                )
        # 14 examples per worker (27 and one padded), both workers' together: DDP's epoch.
        assert saved[local]["examples"] == [28, 28]
        assert (
            "input sharding: each worker's own loader - the DataLoader's DistributedSampler gives each worker "
            "its own 1/2 of the data"
        ) in saved[local]["explain"], saved[local]["explain"]
