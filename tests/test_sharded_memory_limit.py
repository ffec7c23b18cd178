"""Issue 39, item 5: 4 workers, each in its own cgroup v1 memory cgroup limited to its runtime plus 0.4x the whole
model's float32 AdamW training state. MultiWorkerMirroredStrategy (a whole copy per worker: 4x that state and
more) is refused in distribute(), before training, naming the plan, the limit and a configuration that fits;
ShardedStrategy(stage=3) trains to the end under the same limit. Skipped where cgroups cannot be made."""

from __future__ import annotations

import os
import uuid

import pytest
import sharded_limit_cases
from helpers import free_port, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.sharded]

ROOT = "/sys/fs/cgroup/memory"
WORKERS = 4


def make_cgroups() -> list[str]:
    """One fresh memory cgroup per worker under cgroup v1's memory hierarchy, or a skip saying why not."""
    if not os.path.isfile(f"{ROOT}/memory.limit_in_bytes"):
        pytest.skip(f"no cgroup v1 memory controller at {ROOT} (cgroup v2 or none): cannot make per-worker limits")
    parent = f"{ROOT}/stratagem-test-{uuid.uuid4().hex[:8]}"
    try:
        os.mkdir(parent)
        made = [f"{parent}/worker{i}" for i in range(WORKERS)]
        for directory in made:
            os.mkdir(directory)
    except OSError as error:
        pytest.skip(f"cannot make memory cgroups under {ROOT} ({error}): run as root with a writable cgroup v1")
    return made


def remove_cgroups(directories: list[str]) -> None:
    for directory in [*directories, os.path.dirname(directories[0])]:
        try:
            os.rmdir(directory)
        except OSError:
            pass  # a process still inside (a killed rank being reaped): the kernel frees it when it empties


@pytest.mark.timeout(600)
def test_mirrored_is_refused_before_training_and_sharded_trains_under_the_same_cgroup_limit():
    directories = make_cgroups()
    try:
        ports = ([free_port() for _ in range(WORKERS)], [free_port() for _ in range(WORKERS)])
        outcomes = run_ranks(sharded_limit_cases.limited_case, range(WORKERS), args=(directories, *ports), timeout=560)
    finally:
        remove_cgroups(directories)
    for rank, outcome in outcomes.items():
        assert outcome.error is None, (rank, outcome.error)
        got = outcome.value
        refused = got["mirrored"]
        assert refused.startswith(f"MultiWorkerMirroredStrategy on {WORKERS} workers's memory plan needs "), refused
        assert "cgroup v1 /stratagem-test-" in refused and "(memory.limit_in_bytes)" in refused, refused
        assert "Use ShardedStrategy(stage=3) on these workers (its plan: " in refused, refused
        assert got["steps"] == 3, got  # trained to the end, not killed by the kernel
        assert got["peak usage"] <= got["limit"], got
