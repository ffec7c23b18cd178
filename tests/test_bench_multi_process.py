"""The multi-process benchmark's DDP side ends without the hang its reducer can cause (see free_ddp_models)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port

from stratagem import environ

pytestmark = [pytest.mark.multiprocess]

_SCRIPT = """
import json, os, sys, time
import torch, torch.distributed as dist
from stratagem.bench.multi_process import free_ddp_models
from stratagem.cluster.rendezvous import import_group_defaults

def threads():
    return len(os.listdir("/proc/self/task"))

os.environ["GLOO_SOCKET_IFNAME"] = "lo"
start = threads()
import_group_defaults()  # as the benchmark's DDP side does
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
model(torch.ones(3, 4)).sum().backward()
trained = threads()
if sys.argv[1] == "freed":
    del model
    free_ddp_models()
dist.destroy_process_group()
print(json.dumps({"start": start, "trained": trained, "destroyed": threads()}), flush=True)
time.sleep(0.2)  # "kept": the model is freed at exit, after Gloo's threads have gone idle
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc (Linux)")
@pytest.mark.parametrize("order", ["freed", "kept"])
def test_a_ddp_model_freed_first_lets_destroy_process_group_end_gloo_threads(order):
    # DDP's reducer holds the process group; while it lives, destroy_process_group() leaves Gloo's threads
    # running, and freeing the reducer later joins them with the GIL held, which can deadlock with a Gloo
    # thread that needs the GIL. Freed first, the group and its threads end at destroy_process_group().
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, order, str(free_port())],
        check=False,
        env=environ.current(),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["trained"] > counts["start"] + 1, counts  # Gloo's threads were there
    if order == "freed":
        assert counts["destroyed"] <= counts["start"] + 1, counts  # only the TCP store's thread may remain
    else:
        assert counts["destroyed"] >= counts["trained"] - 1, counts  # the reducer kept the group and its threads


@pytest.mark.timeout(180)
def test_the_all_reduce_benchmark_measures_both_paths_and_checks_their_sums():
    proc = subprocess.run(
        [sys.executable, "-m", "stratagem.bench.allreduce", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=170,
        env=dict(environ.current()),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["check_ok"] is True
    for case in ("a_64MiB", "b_500x4KiB"):
        assert result[case]["bucketed_s"] > 0 and result[case]["shared_memory_s"] > 0
