"""Which GPU each worker process takes, and that it is bound before the process group forms.

No GPU and no process group: GPUs are constructed physical devices, torch.cuda.set_device and the
process group's start are recorded by mocks, clusters come from constructed launcher environments.
"""

from __future__ import annotations

import pytest
import torch

from stratagem.cluster import from_slurm, from_torchrun, single_process, worker_group
from stratagem.cluster.worker_group import ranks_sharing_a_gpu, start_process_group
from stratagem.devices import DeviceRegistry
from stratagem.devices.physical import PhysicalDevice
from stratagem.errors import CollectiveTimeoutError, InputError
from stratagem.strategies.worker_group.devices import default_local_devices


def registry_with_gpus(count: int) -> DeviceRegistry:
    cpu = PhysicalDevice(device_type="cpu", name="cpu", core_count=2)
    gpus = [PhysicalDevice(device_type="cuda", index=i, name="H200", total_memory=141 * 2**30) for i in range(count)]
    return DeviceRegistry(physical=[cpu, *gpus])


def torchrun_env(local_rank: int, local_world_size: int) -> dict[str, str]:
    return {
        "RANK": str(local_rank),
        "WORLD_SIZE": str(local_world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }


def slurm_env(local_id: int, per_node: int, **extra: str) -> dict[str, str]:
    return {
        "SLURM_PROCID": str(4 + local_id),
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": str(local_id),
        "SLURM_NTASKS_PER_NODE": str(per_node),
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_ID": "77",
        **extra,
    }


@pytest.mark.parametrize("local_rank", [0, 1, 3])
def test_each_torchrun_rank_takes_the_gpu_of_its_local_rank(local_rank):
    env = torchrun_env(local_rank, 4)
    chosen, decision = default_local_devices(from_torchrun(env), env, registry_with_gpus(4))
    assert chosen == [f"cuda:{local_rank}"]
    assert f"local rank {local_rank} of 4" in decision.reason


def test_each_slurm_task_takes_the_gpu_of_its_slurm_localid():
    env = slurm_env(2, 4)
    chosen, _ = default_local_devices(from_slurm(env), env, registry_with_gpus(4))
    assert chosen == ["cuda:2"]


def test_a_task_whose_launcher_bound_one_gpu_to_it_takes_that_gpu():
    # srun --gpus-per-task=1 gives every task CUDA_VISIBLE_DEVICES of its own GPU: each sees one, as cuda:0.
    env = slurm_env(3, 4, CUDA_VISIBLE_DEVICES="3")
    chosen, decision = default_local_devices(from_slurm(env), env, registry_with_gpus(1))
    assert chosen == ["cuda:0"]
    assert "bound to it" in decision.reason


def test_a_single_worker_process_takes_every_gpu():
    chosen, _ = default_local_devices(single_process(), {}, registry_with_gpus(2))
    assert chosen == ["cuda:0", "cuda:1"]


def test_more_local_workers_than_gpus_is_an_error_rather_than_two_ranks_on_one_gpu():
    env = torchrun_env(2, 3)
    with pytest.raises(InputError, match=r"local rank 2 of 3 on this machine but only 2 GPU\(s\) are visible"):
        default_local_devices(from_torchrun(env), env, registry_with_gpus(2))


def test_two_ranks_on_one_host_holding_one_gpu_are_found():
    placements = [("node1", None, [0]), ("node1", None, [1]), ("node2", None, [1]), ("node1", None, [1])]
    assert ranks_sharing_a_gpu(placements) == ((1, 3), 1)
    # Ranks bound by their launcher (each its own CUDA_VISIBLE_DEVICES) all see their GPU as cuda:0.
    assert ranks_sharing_a_gpu([("node1", "0", [0]), ("node1", "1", [0])]) is None


def test_the_gpu_is_set_before_the_nccl_group_forms_and_given_as_device_id(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(
        worker_group,
        "join_process_group",
        lambda cluster, backend, timeout, *, token, device_id, agent_store=None, group_timeout=None: calls.append(
            ("init", backend, device_id)
        ),
    )
    env = torchrun_env(1, 2)
    start_process_group(from_torchrun(env), [torch.device("cuda", 1)], "nccl", 60.0, token=None)
    assert calls == [("set_device", 1), ("init", "nccl", torch.device("cuda", 1))]


def test_cpu_replicas_leave_the_cuda_device_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(
        worker_group,
        "join_process_group",
        lambda cluster, backend, timeout, *, token, device_id, agent_store=None, group_timeout=None: calls.append(
            ("init", backend, device_id)
        ),
    )
    start_process_group(single_process(), [torch.device("cpu")], "gloo", 60.0, token=None)
    assert calls == [("init", "gloo", None)]


@pytest.mark.parametrize("backend,expected", [("nccl", 60.0 + 2 * 2.0 + 30.0), ("gloo", 60.0)])
def test_the_nccl_group_waits_longer_than_stratagem_so_the_named_error_comes_first(monkeypatch, backend, expected):
    # torch's NCCL watchdog ends a collective at the group's timeout, with its own message and no roll call.
    seen = {}
    monkeypatch.setattr(
        worker_group,
        "join_process_group",
        lambda cluster, backend, timeout, **options: seen.update(timeout=timeout, **options),
    )
    start_process_group(single_process(), [torch.device("cpu")], backend, 60.0, token=None)
    assert seen["timeout"] == 60.0  # the rendezvous keeps the strategy's timeout
    assert seen["group_timeout"] == expected


def test_the_group_timeout_reaches_torch_and_the_rendezvous_keeps_its_own(monkeypatch):
    import datetime

    import torch.distributed as dist

    from stratagem.cluster import init_process_group

    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **options: seen.update(options))
    init_process_group(single_process(), "gloo", timeout=10, group_timeout=44.5)
    assert seen["timeout"] == datetime.timedelta(seconds=44.5)
    init_process_group(single_process(), "gloo", timeout=10)
    assert seen["timeout"] == datetime.timedelta(seconds=10)


# ---- the end-of-data agreement: once per pass when the loaders know their length ------------------------


class CountingWorld:
    """A one-worker CrossWorker stand-in that counts the collectives (a sum over one worker is the value)."""

    rank, world_size, task_name = 0, 1, "worker:0"

    def __init__(self) -> None:
        self.collectives = 0

    def all_reduce_async(self, tensors, *, what, step):
        self.collectives += 1
        return []

    def all_reduce_(self, tensors, *, what, step):
        self.collectives += 1

    def wait(self, works, *, what, step):
        pass

    def check(self):
        pass


class AbortedWorld(CountingWorld):
    """As a CrossWorker whose watchdog aborted the `fails_at`-th collective: what the host then read is garbage,
    and check() raises the recorded error."""

    def __init__(self, fails_at: int) -> None:
        super().__init__()
        self.fails_at = fails_at

    def check(self):
        if self.collectives >= self.fails_at:
            raise CollectiveTimeoutError(f"the collective {self.fails_at} timed out")


def one_worker_dataset(data, shard="data", world=None):
    import types

    from stratagem.strategies.worker_group.input import MultiWorkerDataset, WorkerBatches

    group = types.SimpleNamespace(
        cross_worker=world or CountingWorld(),
        local_devices=[torch.device("cpu")],
        collective_device=torch.device("cpu"),
        rank=0,
    )
    return MultiWorkerDataset(WorkerBatches(group, 1), data, shard), group.cross_worker


def test_loaders_with_a_length_agree_once_per_pass_not_at_every_step():
    batches = [(torch.ones(n, 2), torch.zeros(n)) for n in (4, 3, 2)]
    dataset, world = one_worker_dataset(batches)
    sizes = [x.batch_sizes for x, _ in dataset]
    assert sizes == [(4,), (3,), (2,)] and dataset.steps == 3
    assert world.collectives == 1


def test_a_loader_without_a_length_still_agrees_at_every_step():
    dataset, world = one_worker_dataset(iter([(torch.ones(2, 2), torch.zeros(2))] * 3))
    assert len(list(dataset)) == 3
    assert world.collectives == 1 + 4  # the length round (unknown), then one per batch and one at the end


def test_a_loader_shorter_than_its_length_is_an_error_that_says_so():
    class Lies:
        def __len__(self):
            return 3

        def __iter__(self):
            return iter([(torch.ones(2, 2), torch.zeros(2))])

    dataset, _ = one_worker_dataset(Lies())
    with pytest.raises(InputError, match=r"worker:0's loader stopped after 1 batches although its len\(\) is 3"):
        list(dataset)


def test_a_pass_resumed_mid_epoch_agrees_on_the_batches_left_not_the_epoch_length():
    from stratagem.data import ShuffledBatches

    data = ShuffledBatches((torch.ones(10, 2), torch.zeros(10)), batch_size=3, seed=0)
    data.set_position(0, 2)  # restored after two of the epoch's four batches
    dataset, world = one_worker_dataset(data)
    assert [x.batch_sizes for x, _ in dataset] == [(3,), (1,)]
    assert world.collectives == 1


def test_an_agreement_read_after_the_watchdog_aborted_its_collective_is_never_used():
    # Under NCCL the host reads the agreement after a wait that did not block; the watchdog's error comes first.
    batches = [(torch.ones(2, 2), torch.zeros(2))] * 3
    dataset, _ = one_worker_dataset(iter(batches), world=AbortedWorld(fails_at=3))  # the length, steps 0, 1
    seen = []
    with pytest.raises(CollectiveTimeoutError, match=r"the collective 3 timed out"):
        for x, _ in dataset:
            seen.append(x.batch_sizes)
    assert seen == [(2,)]  # step 0 only: step 1's agreement came from the aborted collective
    dataset, _ = one_worker_dataset(batches, world=AbortedWorld(fails_at=1))
    with pytest.raises(CollectiveTimeoutError, match=r"the collective 1 timed out"):
        next(iter(dataset))


# ---- the NCCL device path's wiring, on Gloo ----------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_an_nccl_strategy_hands_its_collectives_to_a_watchdog_and_trains_as_one_device(monkeypatch, backend):
    import torch.nn.functional as F

    import stratagem as sg
    from stratagem.cluster import free_ports

    # The strategy believes it has chosen NCCL; the group underneath is Gloo (no GPU here), whose wait() blocks.
    monkeypatch.setattr(worker_group, "choose_backend", lambda devices: (backend, "a test"))
    real = worker_group.start_process_group
    monkeypatch.setattr(
        worker_group,
        "start_process_group",
        lambda cluster, devices, _backend, timeout, **kw: real(cluster, devices, "gloo", timeout, **kw),
    )
    cluster = {"cluster": {"worker": [f"127.0.0.1:{free_ports(1)[0]}"]}, "task": {"type": "worker", "index": 0}}
    torch.manual_seed(0)
    net, x, y = torch.nn.Linear(3, 2), torch.randn(4, 3), torch.randn(4, 2)
    reference = torch.nn.Linear(3, 2)
    reference.load_state_dict(net.state_dict())
    strategy = sg.MultiWorkerMirroredStrategy(cluster=cluster, timeout=20)
    try:
        assert (strategy.worker_group.cross_worker.watchdog is not None) == (backend == "nccl")
        model, optimizer = strategy.distribute(net, torch.optim.SGD(net.parameters(), lr=0.5))

        def step(xs, ys):
            F.mse_loss(model(xs), ys).backward()
            optimizer.step()
            optimizer.zero_grad()

        for batch in strategy.distribute_dataset([(x, y)]):
            strategy.run(step, args=batch)
        strategy.worker_group.cross_worker.check()
    finally:
        strategy.close()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    F.mse_loss(reference(x), y).backward()
    ref_opt.step()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-5, atol=1e-6)
