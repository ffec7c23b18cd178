"""The worker group: a plan checked before anything is built, then one process group per job.

The plan's refusals need no process group; two spawned ranks on loopback (free ports) start a group,
see each other, make the plan's DeviceMesh (one `data` axis) and close twice.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
import torch.distributed as dist
from helpers import free_port, run_ranks

import stratagem as sg
from stratagem.cluster import worker_group
from stratagem.cluster.mesh import DeviceMesh
from stratagem.cluster.worker_group import WorkerGroup, choose_backend, plan_worker_group
from stratagem.errors import ClusterError, InputError

JOB = {
    "cluster": {
        "chief": ["127.0.0.1:2222"],
        "worker": ["127.0.0.1:2223", "127.0.0.1:2224"],
        "ps": ["127.0.0.1:2225"],
    },
}


def task(task_type: str, index: int) -> dict:
    return {**JOB, "task": {"type": task_type, "index": index}}


# ---- the plan: resolved and refused before anything is built ---------------------------------------------


def test_a_plan_names_every_rank_in_rank_order_with_the_chief_first():
    plan = plan_worker_group(task("worker", 1), timeout=30, env={})
    assert (plan.rank, plan.world_size, plan.is_chief) == (2, 3, False)
    assert plan.task_names == ("chief:0", "worker:0", "worker:1")
    assert plan.timeout == 30.0 and isinstance(plan.timeout, float)
    assert plan.cluster.task_name == "worker:1"
    assert plan_worker_group(task("chief", 0), timeout=30, env={}).is_chief


def test_a_plan_comes_from_torchruns_variables_when_no_cluster_is_given():
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    plan = plan_worker_group(None, timeout=5, env=env)
    assert (plan.rank, plan.world_size, plan.task_names, plan.cluster.source) == (
        1,
        2,
        ("worker:0", "worker:1"),
        "torchrun",
    )


def test_a_plan_is_a_frozen_value():
    plan = plan_worker_group(None, timeout=5, env={})
    assert (plan.rank, plan.world_size, plan.task_names) == (0, 1, ("worker:0",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.rank = 1  # type: ignore[misc]


def test_a_parameter_server_task_has_no_place_in_a_worker_group():
    with pytest.raises(
        ClusterError,
        match=r"Task ps:0 is not a member of the collective world, so it has no rank in a worker group\. "
        r"Received: task_type='ps'\. Only the chief and workers",
    ):
        plan_worker_group(task("ps", 0), timeout=30, env={})


@pytest.mark.parametrize("timeout", [0, -1.0, math.nan, math.inf, "60", True, None])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_refused(timeout):
    with pytest.raises(
        InputError,
        match=rf"timeout must be a finite number of seconds in \(0, 86400\]\. Received: timeout={re.escape(repr(timeout))}",
    ):
        plan_worker_group(None, timeout=timeout, env={})


def test_a_cluster_of_the_wrong_type_is_refused_by_its_resolution():
    with pytest.raises(ClusterError, match=r"An explicit cluster must be a Cluster or a dict in TF_CONFIG form"):
        plan_worker_group(42, timeout=5, env={})  # type: ignore[arg-type]


def test_a_plans_mesh_is_one_data_axis_over_every_worker_unless_one_is_given():
    assert plan_worker_group(task("worker", 1), timeout=30, env={}).mesh == DeviceMesh((3,), ("data",))
    assert plan_worker_group(None, timeout=5, env={}).mesh == DeviceMesh((1,), ("data",))
    named = plan_worker_group(task("worker", 1), timeout=30, env={}, default_axis="model")
    assert named.mesh == DeviceMesh((3,), ("model",))
    given = DeviceMesh((3, 1), ("data", "model"))
    assert plan_worker_group(task("chief", 0), timeout=30, env={}, mesh=given).mesh is given


def test_a_mesh_whose_product_is_not_the_worker_count_is_refused_before_any_process_group():
    with pytest.raises(
        InputError,
        match=r"The mesh spans 4 workers but the job has 3\. Received: shape=\(2, 2\), "
        r"axis_names=\('data', 'model'\), workers=3\. Give a shape whose product is 3",
    ):
        plan_worker_group(task("worker", 0), timeout=30, env={}, mesh=DeviceMesh((2, 2), ("data", "model")))
    assert not dist.is_initialized()


def test_a_mesh_that_is_not_a_stratagem_device_mesh_is_refused():
    with pytest.raises(InputError, match=r"A worker group's mesh is a stratagem DeviceMesh\. Received: tuple\."):
        plan_worker_group(None, timeout=5, env={}, mesh=(1,))  # type: ignore[arg-type]


def test_the_strategy_refuses_a_bad_plan_before_it_forms_a_process_group():
    with pytest.raises(
        InputError, match=r"timeout must be a finite number of seconds in \(0, 86400\]\. Received: timeout=0"
    ):
        sg.MultiWorkerMirroredStrategy(timeout=0)
    with pytest.raises(ClusterError, match=r"Task ps:0 is not a member of the collective world"):
        sg.MultiWorkerMirroredStrategy(cluster=task("ps", 0), timeout=5)
    assert not dist.is_initialized()


def test_the_backend_is_nccl_only_when_every_local_device_is_a_gpu_and_torch_has_it(monkeypatch):
    assert choose_backend([torch.device("cpu")])[0] == "gloo"
    monkeypatch.setattr(worker_group.dist, "is_nccl_available", lambda: True)
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert choose_backend(gpus) == ("nccl", "every local replica is on a GPU and torch has NCCL")
    assert choose_backend([torch.device("cuda", 0), torch.device("cpu")])[0] == "gloo"
    monkeypatch.setattr(worker_group.dist, "is_nccl_available", lambda: False)
    backend, why = choose_backend(gpus)
    assert backend == "gloo" and "without NCCL" in why


# ---- two ranks start a group ------------------------------------------------------------------------------


def _two_workers(rank: int, port: int) -> dict:
    return {
        "cluster": {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}"]},
        "task": {"type": "worker", "index": rank},
    }


def _start_and_close_twice(rank: int, port: int) -> dict:
    from stratagem import environ

    env = environ.current()
    plan = plan_worker_group(_two_workers(rank, port), timeout=30, env=env)
    group = WorkerGroup.start(plan, [torch.device("cpu")], env=env)
    try:
        total = torch.tensor([rank + 1.0])
        group.cross_worker.all_reduce_([total], what="a test sum", step=0)
        mesh = group.device_mesh()
        on_mesh = torch.tensor([10.0 * (rank + 1)])
        dist.all_reduce(on_mesh, group=mesh.get_group())
        seen = {
            "rank": group.rank,
            "world_size": group.world_size,
            "task_names": group.task_names,
            "is_chief": group.is_chief,
            "backend": group.backend,
            "decisions": [(d.subject, d.choice) for d in group.decisions()],
            "sum": total.item(),
            "mesh": (mesh.device_type, mesh.size(), mesh.get_local_rank(), mesh.mesh_dim_names),
            "mesh_once": group.device_mesh() is mesh,
            "mesh_sum": on_mesh.item(),
        }
    finally:
        group.close()
    group.close()
    seen["initialized_after_close"] = dist.is_initialized()
    with pytest.raises(InputError, match=r"The worker group of worker:\d is closed, so it has no device mesh"):
        group.device_mesh()
    return seen


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_ranks_start_a_group_see_each_other_make_a_mesh_and_close_twice():
    outcomes = run_ranks(_start_and_close_twice, [0, 1], args=(free_port(),), timeout=100)
    for rank, outcome in outcomes.items():
        assert outcome.error is None, outcome.error
        assert outcome.value == {
            "rank": rank,
            "world_size": 2,
            "task_names": ("worker:0", "worker:1"),
            "is_chief": rank == 0,
            "backend": "gloo",
            "decisions": [("cross-worker backend", "gloo")],
            "sum": 3.0,  # 1 + 2
            "mesh": ("cpu", 2, rank, ("data",)),
            "mesh_once": True,
            "mesh_sum": 30.0,  # 10 + 20
            "initialized_after_close": False,
        }


def _start_with_devices(rank: int, port: int) -> tuple[str, bool]:
    from stratagem import environ

    env = environ.current()
    plan = plan_worker_group(_two_workers(rank, port), timeout=30, env=env)
    devices = [torch.device("cpu")] * (rank + 1)  # worker:0 holds one, worker:1 two
    try:
        WorkerGroup.start(plan, devices, env=env)
    except InputError as error:
        return str(error), dist.is_initialized()
    return "started", dist.is_initialized()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_workers_holding_different_numbers_of_devices_are_refused_and_the_group_is_freed():
    outcomes = run_ranks(_start_with_devices, [0, 1], args=(free_port(),), timeout=100)
    for outcome in outcomes.values():
        assert outcome.error is None, outcome.error
        message, initialized = outcome.value
        assert message.startswith(
            "Every worker must hold the same number of local replicas. Received: worker:0: 1, worker:1: 2."
        )
        assert not initialized


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_strategy_hands_out_its_group_and_explains_the_backend_before_the_sums():
    cluster = {"cluster": {"worker": [f"127.0.0.1:{free_port()}"]}, "task": {"type": "worker", "index": 0}}
    strategy = sg.MultiWorkerMirroredStrategy(cluster=cluster, timeout=30, shared_memory=False)
    try:
        group = strategy.worker_group
        assert (group.rank, group.world_size, group.task_names, group.is_chief) == (0, 1, ("worker:0",), True)
        assert group.local_devices == [torch.device("cpu")]
        assert strategy.input_pipeline() == (1, 0)
        subjects = [d.subject for d in strategy.explain().decisions]
        assert subjects.index("cross-worker backend") + 1 == subjects.index("cross-worker sums")
        assert strategy.explain().decision("cross-worker backend").choice == "gloo"
    finally:
        strategy.close()
    strategy.close()
    assert group.closed and not dist.is_initialized()
